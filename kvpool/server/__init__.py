"""The OpenAI-compatible HTTP server: `build_app(engine, ServerConfig)` in `app.py`; the
`kvpool serve` command is `kvpool/cli/serve.py`. Importing this package loads nothing heavy."""
