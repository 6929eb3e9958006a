"""Services: every write and lifecycle step of sandboxes and their operations."""
