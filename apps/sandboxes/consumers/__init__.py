"""Websocket consumers: realtime state, exec streams, PTY (see docs/realtime.md)."""
