"""The Starlette app, the async client SDK and the command line."""
