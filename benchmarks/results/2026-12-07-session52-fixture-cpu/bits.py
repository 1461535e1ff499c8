import os, sys
import ckvp_compile.latent.planner as pl
pl.BIT_CHOICES = tuple(int(b) for b in os.environ["BITS"].split(","))
from ckvp_compile.bench.cli import main
sys.exit(main(sys.argv[1:]))
