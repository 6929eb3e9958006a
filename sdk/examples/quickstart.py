"""Quick start: one sandbox, a command, a file. Run after `make up`:

set -a; . .state/demo.env; set +a
python sdk/examples/quickstart.py
"""

from __future__ import annotations

import hedgerow


def main() -> None:
    with hedgerow.Client() as client, client.create_sandbox(cpu="500m", memory="512Mi") as sb:
        result = sb.exec("echo hello from $(hostname); exit 3")
        print(result.termination, result.exit_code, result.stdout.strip())
        sb.write_file("/workspace/notes.txt", "written by the SDK\n")
        print(sb.read_file("/workspace/notes.txt").decode().strip())
        print([entry["name"] for entry in sb.list_files("/workspace")])


if __name__ == "__main__":
    main()
