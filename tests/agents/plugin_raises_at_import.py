"""A plug-in module that fails while it is imported (loaded as `plugin_raises_at_import:<name>`)."""

raise RuntimeError("broken at import time")
