"""``python -m p2p_kv.doctor``: the same as ``p2p-kv doctor``."""

import sys

from p2p_kv.doctor import main

if __name__ == "__main__":
    sys.exit(main())
