import sys

from slipstream.gpucheck.runner import main

sys.exit(main())
