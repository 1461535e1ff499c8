"""Runtime state of the rewrites: the latent KV store, its binding to graphs, and the caches users hold.

``hf_cache`` (CKVPStaticCache, use_latent_cache) imports transformers; import it directly.
"""

from .store import LatentKVStore, StoreBytes, lookup_phantom

__all__ = ["LatentKVStore", "StoreBytes", "lookup_phantom"]
