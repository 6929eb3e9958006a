"""The agent zygote (``daemon.py``): the local backend's per-instance host-root daemon that
forks sandbox agents from one already-imported process. Standard library and the
``podagent`` package only (the import contract says so); started by
``apps/sandboxes/backends/local/zygote.py``, docs/local-backend.md "Process model"."""
