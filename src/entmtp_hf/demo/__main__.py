"""``python -m entmtp_hf.demo``: see :mod:`entmtp_hf.demo.run`."""

from .run import main

raise SystemExit(main())
