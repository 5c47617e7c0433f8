#!/bin/sh
# The container's entry point: `sdvg serve` on all interfaces, which needs a token. It comes from the file
# SDVG_SERVE_TOKEN_FILE names (a mounted secret: preferred) or from SDVG_SERVE_TOKEN, never from HF_TOKEN
# (that one is huggingface_hub's, for downloads). Arguments go to `sdvg serve` (e.g. --preset wan2.1).
# Refused before anything loads (exit 2), naming the variable and the fix: both set, an unreadable or empty
# token file, no token at all.
set -eu
token=${SDVG_SERVE_TOKEN:-}
file=${SDVG_SERVE_TOKEN_FILE:-}
if [ -n "$file" ]; then
  if [ -n "$token" ]; then
    echo "error: both SDVG_SERVE_TOKEN and SDVG_SERVE_TOKEN_FILE are set; keep one (the file: a mounted secret)" >&2
    exit 2
  fi
  if [ ! -f "$file" ] || [ ! -r "$file" ]; then
    echo "error: SDVG_SERVE_TOKEN_FILE=$file cannot be read (no such file, not a file, or no permission); mount" \
         "the token there, e.g. docker run -v /etc/sdvg/token:$file:ro ..." >&2
    exit 2
  fi
  if [ -z "$(tr -d '\r\n' < "$file")" ]; then
    echo "error: SDVG_SERVE_TOKEN_FILE=$file is empty; write the token into it" >&2
    exit 2
  fi
  # The server reads the file itself: the token never reaches argv, where `ps` would show it.
  exec sdvg serve --host 0.0.0.0 --port "${SDVG_SERVE_PORT:-8000}" --token-file "$file" "$@"
fi
if [ -z "$token" ]; then
  echo "error: no token: the server listens on every interface of the container, which sdvg serve allows only" \
       "with one; set SDVG_SERVE_TOKEN_FILE to a mounted file holding it (or SDVG_SERVE_TOKEN)" >&2
  exit 2
fi
# SDVG_SERVE_TOKEN stays in the environment, where sdvg serve reads it (not in argv).
exec sdvg serve --host 0.0.0.0 --port "${SDVG_SERVE_PORT:-8000}" "$@"
