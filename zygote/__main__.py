"""python3 -m zygote --socket PATH"""

import sys

from zygote.daemon import main

sys.exit(main())
