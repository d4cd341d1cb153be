"""An OpenAI-compatible HTTP server over one Session (`pip install "libkk[serve]"`).

`build_app(session)` (libkk.serve.app) is the FastAPI app; `run_server(session, ...)`
(libkk.serve.runner) serves it with uvicorn and shuts down cleanly on SIGTERM. Neither is
imported by `import libkk`: FastAPI and uvicorn are an optional extra.
"""
