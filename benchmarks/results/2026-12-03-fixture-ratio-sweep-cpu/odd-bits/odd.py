import sys
import ckvp_compile.latent.planner as P
P.BIT_CHOICES = tuple(int(b) for b in sys.argv[1].split(","))
from ckvp_compile.bench.cli import main
sys.exit(main(["decode"] + sys.argv[2:]))
