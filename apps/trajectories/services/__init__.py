"""Services: every write to episodes and steps."""
