"""Cross-origin access (CORS) for browser apps, with vLLM's flags and defaults.

`--allowed-origins`, `--allowed-methods`, `--allowed-headers` (default `*` each, as vLLM) and
`--allow-credentials` (default off) configure Starlette's CORSMiddleware, installed outside
authentication: a browser's preflight (OPTIONS with `Access-Control-Request-Method`) carries
no Authorization header by design, so it is answered here and never reaches the 401; every
other request, and the actual call after the preflight, still needs its key.

Why `*` stays the default with API keys: kvpool authenticates with a bearer key that the page
itself must send, never with a cookie the browser adds on its own, so an allowed origin gains
nothing a key-less `curl` would not. Credentialed CORS is the unsafe case (Starlette answers a
wildcard with the caller's own origin), so `--allow-credentials` needs origins named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

WILDCARD = ("*",)


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """Which origins, methods and request headers browsers may use across origins."""

    allowed_origins: tuple[str, ...] = WILDCARD
    allowed_methods: tuple[str, ...] = WILDCARD
    allowed_headers: tuple[str, ...] = WILDCARD
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials needs --allowed-origins to name the origins "
                             "(a wildcard would let every site send the browser's credentials)")


def install_cors(app: FastAPI, config: CorsConfig) -> None:
    """Add the CORS middleware; call it after every other middleware, so it runs first."""
    from fastapi.middleware.cors import CORSMiddleware  # here: `kvpool --help` stays light

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(config.allowed_origins),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
    )
