"""Run GPU-marked tests on the CPU emulator: python -m tests.cuda_emu.run [pytest args...]
(default: tests/test_gpu_decode.py). Slow; for kernel-logic checks before a device run."""
from __future__ import annotations

import sys

from tests.cuda_emu import emu


def main(argv=None) -> int:
    emu.install()
    import pytest

    args = list(sys.argv[1:] if argv is None else argv) or ["tests/test_gpu_decode.py"]
    return pytest.main(["-p", "no:cacheprovider", *args])


if __name__ == "__main__":
    raise SystemExit(main())
