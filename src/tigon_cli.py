"""Launcher of the ``tigon`` command. It lives outside the ``tigon`` package because importing
``tigon`` imports triton, and without a GPU Triton must see TRITON_INTERPRET=1 before that first
import for tigon's kernels to run (interpreted) at all."""

import os
import sys


def main() -> int:
    if "TRITON_INTERPRET" not in os.environ and sys.argv[1:2] != ["bench"]:
        import torch  # does not import triton

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    from tigon.cli import main as tigon_main

    return tigon_main()


if __name__ == "__main__":
    sys.exit(main())
