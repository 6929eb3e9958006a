"""A recorded episode: the commands run inside the block become the episode's steps,
and the control plane attributes a failure to the environment, the verifier or the
policy from its own ledger when the episode closes (docs/trajectories.md)."""

from __future__ import annotations

import hedgerow


def main() -> None:
    with hedgerow.Client() as client, client.create_sandbox() as sb:
        with sb.episode(task_id="add-two-numbers", harness="example", model="none") as ep:
            sb.write_file("/workspace/add.py", "print(2 + 2)\n")
            sb.exec("python3 /workspace/add.py")  # recorded as a step
            ep.verify("test $(python3 /workspace/add.py) = 4", timeout=30)
        print("episode", ep.id)


if __name__ == "__main__":
    main()
