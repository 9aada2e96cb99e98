"""Build a `RewardPool` from the run config's `reward` section (and its local service, if any)."""
from __future__ import annotations

from moeloop.config.schema import RewardSection
from moeloop.errors import InputError
from moeloop.reward.breaker import CircuitBreaker
from moeloop.reward.composite import CompositeReward
from moeloop.reward.pool import RewardPool
from moeloop.reward.registry import RewardFn, get_reward_fn
from moeloop.reward.remote import RemoteReward
from moeloop.reward.supervisor import ServiceSupervisor


def build_pool(section: RewardSection) -> RewardPool:
    """`reward.server.serve_fn` set: start that function as a supervised local service, score via
    HTTP. Otherwise `reward.fn` (built-in or dotted path; `http` uses `reward.server.url`)."""
    section.check()
    if section.fns and (section.server.serve_fn or section.fn == "http"):  # (checked before a service starts)
        raise InputError("reward.fns: combines local functions; a reward service (reward.server.serve_fn, "
                         "reward.fn=http) serves one function")
    if section.fns and section.executor == "process":
        raise InputError("reward.executor=process: reward.fns runs its sync components in threads; use "
                         "reward.executor=thread")
    supervisor = _start_service(section) if section.server.serve_fn else None
    fn = _build_fn(section, supervisor)
    pool = RewardPool(fn, concurrency=section.concurrency, timeout_s=section.timeout_s, retries=section.retries,
                      backoff_s=section.backoff_s, fallback=section.fallback, neutral_score=section.neutral_score,
                      breaker=CircuitBreaker(section.breaker_failures, section.breaker_reset_s),
                      executor=section.executor)
    if supervisor is not None:
        pool.owned.append(supervisor)
    return pool


def _start_service(section: RewardSection) -> ServiceSupervisor:
    srv = section.server
    return ServiceSupervisor(srv.serve_fn, host=srv.host, port=srv.port, token=srv.token,
                             health_interval_s=srv.health_interval_s, startup_timeout_s=srv.startup_timeout_s,
                             max_restarts=srv.max_restarts, concurrency=section.concurrency,
                             fn_options=section.fn_options).start()


def _build_fn(section: RewardSection, supervisor: ServiceSupervisor | None) -> RewardFn:
    if section.fns:
        return CompositeReward(section.fns)
    if supervisor is not None:
        return RemoteReward(token=section.server.token, supervisor=supervisor)
    if section.fn == "http":
        return RemoteReward(url=section.server.url, token=section.server.token)
    return get_reward_fn(section.fn, **section.fn_options)
