"""What the processes of one ember cluster share: its secret, and the proofs made from it.

The secret ($EMBER_CLUSTER_SECRET; `ember up` makes a fresh one for its processes) never
crosses the wire. Four things are derived from it:

- the router's token, sent to workers as `x-ember-router-token` (`ember.headers`): a
  worker that has the secret serves its API (`/v1/*`, `/tokenize`, `/detokenize`) only to
  requests carrying it, so a client can neither reach a worker around the router nor hand
  it cluster-internal fields (`kv_transfer_params`);
- the signature of a handed-over prefill: the prefill worker's API process signs the
  `remote_prefill` object it returns, and a decode worker acts only on a signed one, so
  the KV endpoint, block ids and first tokens it reads are a cluster prefill worker's,
  never a client's (nor a faulty router's);
- the KV endpoints' own challenge (`ember/kv/wire.py`), on every KV connection;
- the member token, sent to a router as `x-ember-member-token` by whoever adds or
  removes its workers (`POST /workers`, `DELETE /workers/{id}`: `ember serve --register`,
  an operator's `ember workers`), so no client can point the router at a host of its
  choosing or drain the fleet.
"""

from __future__ import annotations

import hashlib
import hmac


def _mac(secret: bytes, purpose: bytes, payload: bytes = b"") -> str:
    return hmac.new(secret, b"ember:" + purpose + b":" + payload, hashlib.sha256).hexdigest()


def router_token(secret: bytes) -> str:
    """The token a cluster's router shows its workers."""
    return _mac(secret, b"router-token")


def member_token(secret: bytes) -> str:
    """The token that may change a cluster's router's workers."""
    return _mac(secret, b"member-token")


def is_member(secret: bytes | None, token: str | None) -> bool:
    """Whether `token` (a request's member-token header) proves the cluster's secret."""
    if not secret or not token:
        return False
    return hmac.compare_digest(token.encode(), member_token(secret).encode())


def is_router(secret: bytes | None, token: str | None) -> bool:
    """Whether `token` (a request's router-token header) proves the cluster's router."""
    if not secret or not token:
        return False
    return hmac.compare_digest(token.encode(), router_token(secret).encode())


def sign(secret: bytes, payload: bytes) -> str:
    """A signature of `payload` (the canonical bytes of a handed-over prefill)."""
    return _mac(secret, b"remote-prefill", payload)


def verify(secret: bytes | None, payload: bytes, signature: str) -> bool:
    if not secret or not signature:
        return False
    return hmac.compare_digest(signature.encode(), sign(secret, payload).encode())
