"""A FUSE filesystem, in pure Python over /dev/fuse, that loses what was not made durable.

`protocol` (the kernel's wire format), `model` (volatile and durable state, the cut),
`daemon` (mount(2), the request loop, in its own process), `control` (the test's handle:
start, cut, close). Used by tests/test_powercut_fs.py and tests/test_power_cut.py.
"""

from astra.testing.powercut.control import PowerCutMount, PowerCutUnavailable

__all__ = ["PowerCutMount", "PowerCutUnavailable"]
