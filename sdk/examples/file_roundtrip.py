"""File round-trips: bytes, a large streamed file, and a whole directory tree."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import hedgerow


def main() -> None:
    with hedgerow.Client() as client, client.create_sandbox() as sb:
        sb.write_file("/workspace/small.bin", b"\x00\x01\x02")
        assert sb.read_file("/workspace/small.bin") == b"\x00\x01\x02"

        with tempfile.TemporaryDirectory() as tmp:
            big = Path(tmp) / "big.bin"
            big.write_bytes(os.urandom(16 * 1024 * 1024))  # streamed both ways
            sb.upload(big, "/workspace/big.bin")
            sb.download("/workspace/big.bin", Path(tmp) / "back.bin")
            same = (
                hashlib.sha256(big.read_bytes()).hexdigest()
                == hashlib.sha256((Path(tmp) / "back.bin").read_bytes()).hexdigest()
            )
            print("16 MiB round trip intact:", same)

            tree = Path(tmp) / "project"
            (tree / "src").mkdir(parents=True)
            (tree / "src" / "main.py").write_text("print('hi')\n")
            (tree / "README").write_text("demo\n")
            sb.upload(tree, "/workspace/project")
            print(sb.exec("cd /workspace/project && find . -type f | sort").stdout)
            sb.download("/workspace/project", Path(tmp) / "copy")
            print(sorted(str(p.relative_to(tmp)) for p in (Path(tmp) / "copy").rglob("*")))


if __name__ == "__main__":
    main()
