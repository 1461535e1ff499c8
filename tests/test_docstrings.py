"""Every public function and class of the package, and every public method of a public class, has a docstring
(inherited ones count: an override documented by its base, as ``CKVPPass.apply`` or ``nn.Module.forward``)."""

import importlib
import inspect
import pkgutil

import ckvp_compile


def _public_objects():
    for info in pkgutil.walk_packages(ckvp_compile.__path__, "ckvp_compile."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) != mod.__name__:  # documented where it is defined
                continue
            yield f"{mod.__name__}.{name}", obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and inspect.isfunction(member):
                        yield f"{mod.__name__}.{name}.{attr}", getattr(obj, attr)


def test_every_public_function_and_class_has_a_docstring():
    objects = dict(_public_objects())
    assert len(objects) > 300, len(objects)  # the walk found the package
    missing = sorted(name for name, obj in objects.items() if not (inspect.getdoc(obj) or "").strip())
    assert not missing, "public objects without a docstring:\n" + "\n".join(missing)
