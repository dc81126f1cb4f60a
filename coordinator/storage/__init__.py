"""The coordinator's durable state: its SQLite store, schema, checkpointer and the status
summary read from it."""
