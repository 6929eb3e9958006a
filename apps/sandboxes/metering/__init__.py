"""Metering driven by the sandboxes: the usage ledger follows the lifecycle ledger
(``usage.py``), the storage ledger follows the snapshots (``storage.py``). Billing owns
the tables, the price books and what a record costs; this package knows when a sandbox
or a snapshot starts and stops holding resources."""
