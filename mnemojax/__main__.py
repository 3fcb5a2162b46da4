import sys

from mnemojax._src.cli import main

sys.exit(main())
