import sys

from slipstream.system.gpucheck.runner import main

sys.exit(main())
