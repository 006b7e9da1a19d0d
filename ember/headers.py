"""The HTTP headers ember's processes and clients share, each named once."""

from __future__ import annotations

SESSION_HEADER = "x-session-affinity"  # a client's session: routed home, logged, echoed
WORKER_HEADER = "x-ember-worker"  # the worker a router sent the request to
PREFILL_HEADER = "x-ember-prefill-worker"  # ... and its prefill worker, when disaggregated
RESPONSE_ID_HEADER = "x-ember-response-id"  # a /v1/responses id: the router keeps its home
ROUTER_TOKEN_HEADER = "x-ember-router-token"  # a cluster's router proving itself to workers
MEMBER_TOKEN_HEADER = "x-ember-member-token"  # who adds or removes a router's workers
STREAM_TOKENS_HEADER = "x-ember-stream-tokens"  # a router asking for a stream's token trail
TENANT_HEADER = "x-ember-tenant"  # the tenant of the API key a router checked, to workers
