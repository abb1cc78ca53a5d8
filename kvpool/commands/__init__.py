"""The user-facing commands of the `kvpool` CLI that run the engine: generate, chat."""
