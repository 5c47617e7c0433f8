"""`sdvg serve`: a realtime websocket server speaking Krea Realtime Video's wire format (docs/server.md).

One component per file: `config` (limits), `protocol` (client messages), `security` (bind rule,
token, ids, rate), `engine` (the pipeline adapter), `sessions` (the generation worker and the
sessions it interleaves), `encode` (frames on the wire), `uploads`, `videos` (the MP4 of each
session), `metrics`, `app` (FastAPI routes), `listen` (the socket, bound before any model loads),
`server` (uvicorn with a draining shutdown), `cli`.
Nothing here is imported by `import sdvg`; fastapi and friends are the `serve` extra.
"""
