"""`python -m aiofabric ...`: the command line (what `connect_peer` runs on the remote host)."""
import sys

from .tools.entry import main

sys.exit(main())
