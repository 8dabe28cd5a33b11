"""What `engine serve` puts around the engine: load limits, access control, request logs."""

from __future__ import annotations

import attrs
from attrs.validators import and_, ge, gt, instance_of, min_len, optional

DEFAULT_MAX_WAITING_REQUESTS = 256
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
RETRY_AFTER_S = 1  # the Retry-After of a 429: about how long a waiting request takes to start


@attrs.frozen
class ServerOptions:
    """One server's settings beside the engine's (`EngineConfig`); each is a flag of
    `engine serve` (`max_waiting_requests` is `--max-waiting-requests`)."""

    # requests submitted and not yet admitted; past it a request gets 429. None: no bound
    max_waiting_requests: int | None = attrs.field(
        default=DEFAULT_MAX_WAITING_REQUESTS,
        # attrs' stub takes the field's type from the default alone (int), so a validator of
        # `int | None` is refused (python-attrs/attrs#515, open)
        validator=optional(and_(instance_of(int), ge(1))),  # type: ignore[arg-type]
    )
    # seconds from arrival after which a request is aborted (408). None: no deadline
    request_timeout_s: float | None = attrs.field(
        default=None, validator=optional(and_(instance_of((int, float)), gt(0)))
    )
    # larger request bodies get 413
    max_body_bytes: int = attrs.field(
        default=DEFAULT_MAX_BODY_BYTES, validator=[instance_of(int), ge(1)]
    )
    # every endpoint but /health then needs `Authorization: Bearer <api_key>`
    api_key: str | None = attrs.field(default=None, validator=optional(min_len(1)))
    # origins CORS allows ("*": any); none: no CORS headers at all
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # one log line per generation request: id, tokens, TTFT, finish reason (no prompt text)
    log_requests: bool = attrs.field(default=False, validator=instance_of(bool))
    # the request lines also carry the prompt (implies log_requests)
    log_prompts: bool = attrs.field(default=False, validator=instance_of(bool))
    # a greedy and a sampled request through the engine before listening (`warm_up`)
    warm_up: bool = attrs.field(default=True, validator=instance_of(bool))

    @property
    def logs_requests(self) -> bool:
        return self.log_requests or self.log_prompts
