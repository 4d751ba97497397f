"""Per-rank Prometheus endpoint (port = train.metrics_port + rank); metric names are a dashboard contract."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

NAMES = {
    "step": "nightloom_step",
    "loss": "nightloom_loss",
    "grad_norm": "nightloom_grad_norm",
    "tokens_per_s": "nightloom_tokens_per_second",
    "step_time_s": "nightloom_step_time_seconds",
    "mfu": "nightloom_mfu",
    "memory_bytes": "nightloom_memory_bytes",
    "collective_latency_s": "nightloom_collective_latency_seconds",
}
EVAL_NAMES = {"eval_loss": "nightloom_eval_loss", "eval_ppl": "nightloom_eval_perplexity"}  # set when evaluated
_HELP = {
    "step": "Last completed optimizer step",
    "loss": "Global mean training loss of the last step",
    "grad_norm": "Global gradient norm before clipping",
    "tokens_per_s": "Global tokens per second of the last step",
    "step_time_s": "Wall time of the last optimizer step",
    "mfu": "Model FLOPs utilisation of the last step (PaLM App. B)",
    "memory_bytes": "Peak memory of this rank (CUDA allocated, or CPU max RSS)",
    "collective_latency_s": "Latency of a one-element all-reduce over all ranks",
    "eval_loss": "Held-out token-weighted mean NLL at the last evaluation",
    "eval_ppl": "Held-out perplexity exp(eval_loss) at the last evaluation",
}


class RankMetrics:
    """Gauges labelled (run, rank) on this rank's own registry and HTTP server."""

    def __init__(self, port: int, run: str, rank: int):
        self.registry = CollectorRegistry()
        self.labels = {"run": run, "rank": str(rank)}
        names = {**NAMES, **EVAL_NAMES}
        self.gauges = {k: Gauge(n, _HELP[k], ["run", "rank"], registry=self.registry) for k, n in names.items()}
        self.server, self.thread = start_http_server(port, addr="0.0.0.0", registry=self.registry)

    def update(self, **values: float | None) -> None:
        for k, v in values.items():
            if v is not None:
                self.gauges[k].labels(**self.labels).set(v)

    def experts(self, tokens: list[int], aux: float | None) -> None:
        """Mixture of experts: tokens routed to each expert in the last step (gauge per `expert`), max/mean, and
        the router's load-balancing loss; created on first use, so dense runs export none of them."""
        from nightloom.train.moe import imbalance

        if "expert_tokens" not in self.gauges:
            self.gauges["expert_tokens"] = Gauge(
                "nightloom_expert_tokens",
                "Tokens routed to this expert in the last step (all ranks, summed over MoE layers)",
                ["run", "rank", "expert"],
                registry=self.registry,
            )
            for k, n, h in (
                ("expert_imbalance", "nightloom_expert_imbalance", "Max / mean tokens per expert (1 = balanced)"),
                ("router_aux_loss", "nightloom_router_aux_loss", "Router load-balancing loss (unscaled)"),
            ):
                self.gauges[k] = Gauge(n, h, ["run", "rank"], registry=self.registry)
        for e, n in enumerate(tokens):
            self.gauges["expert_tokens"].labels(**self.labels, expert=str(e)).set(n)
        self.update(expert_imbalance=imbalance(tokens), router_aux_loss=aux)

    def preference(self, figures: dict[str, float]) -> None:
        """train.task dpo and grpo: a gauge per figure (TRL's name, "/" as "_": nightloom_rewards_accuracies,
        nightloom_eval_rewards_margins, nightloom_reward, nightloom_completions_mean_length, ...), created on first
        use."""
        for k, v in figures.items():
            key = "pref:" + k
            if key not in self.gauges:
                name = "nightloom_" + k.replace("/", "_")
                self.gauges[key] = Gauge(name, f"Post-training: {k}", ["run", "rank"], registry=self.registry)
            self.gauges[key].labels(**self.labels).set(v)

    def close(self) -> None:
        self.server.shutdown()
