"""The parts a configuration change rebuilds, as one value, and the one place that swaps them.

A reload or an admin change builds a new :class:`Live` from the new config (:func:`build_live`) and
swaps it in with :meth:`LiveParts.swap`; whoever keeps parts of it (the request path) subscribed and
takes the new ones then. Requests in flight keep the references they already read; the next step
of each reads the new ones. Parts that live as long as the process (the store, metrics, the lease
keeper, the router, which reconfigures itself in place) are not here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from budgets.types import BudgetLayout
from classifiers import Classifier, Pricer, TokenizerRegistry
from classifiers.prompt_overhead import PromptOverheads
from gateway.config.layout import build_layout
from gateway.config.modeltable import ModelTable
from gateway.config.schema import GatewayConfig, TenantConfig
from gateway.request import slots
from gateway.request.auth import Authenticator
from gateway.request.passthrough import PassthroughRoutes
from gateway.request.reservations import Reservations

log = logging.getLogger("tokengate")


@dataclass(frozen=True)
class Live:
    config: GatewayConfig
    auth: Authenticator
    tenants: tuple[TenantConfig, ...]  # the configured tenants, or the open-mode tenant
    classifier: Classifier | None
    models: ModelTable
    pricer: Pricer
    prompt_overheads: PromptOverheads  # what engines count beyond the prices, learned per model
    passthrough: PassthroughRoutes
    reservations: Reservations
    layout: BudgetLayout  # the budget store's pools, as the config implies them


def build_live(
    config: GatewayConfig,
    previous: Live | None,
    key_expiries: Mapping[str, float],
    kv_usage: Callable[[str], float | None],
) -> Live:
    """The parts ``config`` implies. From ``previous`` it keeps what is worth keeping: the pricer (its
    tokenizer caches) while models and pricing are unchanged, and what reservations learned."""
    auth = Authenticator(config, key_expiries)
    tenants = config.tenants or ((auth.open_tenant,) if auth.open_tenant else ())
    if (
        previous is None
        or previous.config.models != config.models
        or previous.config.pricing != config.pricing
    ):
        models = ModelTable(config.models)
        if previous is not None:
            previous.pricer.close()  # its queued encodes fall back to counting inline; none fails
        pricer = Pricer(
            TokenizerRegistry(models=models.tokenizer_specs()),
            config.pricing.settings,
            models.image_rules(),
            models.vocab_sizes(),
        )
        # What engines count beyond the prices is learned again against the new pricer.
        prompt_overheads = PromptOverheads()
    else:
        models, pricer, prompt_overheads = previous.models, previous.pricer, previous.prompt_overheads
    reservations = Reservations(
        config.reservation, dict(config.reservation_by_pool), dict(config.reservation_by_class), kv_usage
    )
    if previous is not None:
        reservations.carry_over(previous.reservations)  # what was learned stays
    for warning in slots.load_warnings(config):
        log.warning("config: %s", warning)
    return Live(
        config=config,
        auth=auth,
        tenants=tenants,
        classifier=Classifier(config.classes) if config.classes else None,
        models=models,
        pricer=pricer,
        prompt_overheads=prompt_overheads,
        passthrough=PassthroughRoutes(config.passthrough),
        reservations=reservations,
        layout=build_layout(config, config.classes, tenants),
    )


class LiveParts:
    """The current :class:`Live`; :meth:`swap` replaces it and tells every subscriber."""

    def __init__(self, live: Live) -> None:
        self.current = live
        self._subscribers: list[Callable[[Live], None]] = []

    def subscribe(self, on_swap: Callable[[Live], None]) -> None:
        self._subscribers.append(on_swap)

    def swap(self, live: Live) -> None:
        self.current = live
        for on_swap in self._subscribers:
            on_swap(live)
