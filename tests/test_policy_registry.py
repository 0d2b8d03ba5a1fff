"""The tree-policy registry: every built-in policy is registered with what it owns, the readers
of a policy name ask the registry, and a policy registered from outside decodes like the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from test_generation import enabled, prompts

from entmtp_hf import ConfigError, EntMTPConfig
from entmtp_hf.banks.bank import TopologyBank
from entmtp_hf.scheduling import policies
from entmtp_hf.scheduling.policies import (
    NEEDS_ENTROPIES,
    NEEDS_FEATURE,
    NEEDS_NOTHING,
    NEEDS_VALUES,
    Scheduler,
    get_policy,
    policy_names,
    register_policy,
)
from entmtp_hf.trees.tree import Tree

CHAIN = [[0], [0, 0]]
TREES = [[[0]], CHAIN]


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for the test to register into (the real one is left as it was)."""
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))
    monkeypatch.setattr(policies, "_ALIASES", dict(policies._ALIASES))


@dataclass
class AboveRule:
    """Tree ``top`` when the confidence is above ``level``, else tree 0."""

    num_trees: int
    level: float = 0.1
    top: int = 1
    current: int = field(init=False, default=0)

    def choose(self, s: float) -> int:
        self.current = self.top if s > self.level else 0
        return self.current


def test_the_built_in_policies_and_what_they_own():
    assert policy_names() == ["static", "hysteresis", "ladder", "value", "entropy"]
    assert policy_names(in_banks=True) == ["static", "hysteresis", "ladder", "value"]  # a bank stores no EAS settings
    needs = {name: get_policy(name).needs for name in policy_names()}
    assert needs == {
        "static": NEEDS_NOTHING,
        "hysteresis": NEEDS_FEATURE,
        "ladder": NEEDS_FEATURE,
        "value": NEEDS_VALUES,
        "entropy": NEEDS_ENTROPIES,
    }
    assert get_policy("hysteresis").arguments == {"low": 0, "high": 0, "tau_on": 0.01, "tau_off": 0.01}
    assert get_policy("ladder").arguments == {"thresholds": ()} and get_policy("entropy").arguments == {}
    assert get_policy("EntMTPτ").name == "hysteresis" and get_policy("EntMTP-v").name == "value"
    assert policies.POLICIES == ("static", "hysteresis", "ladder", "value")
    assert policies.FEATURE_POLICIES == ("hysteresis", "ladder") and policies.POLICY_ALIASES["EntMTP*"] == "static"


@pytest.mark.parametrize("policy", ["fastest", [1], {"a": 1}, 3, None, b"static"])
def test_an_unknown_or_unhashable_policy_is_a_config_error_listing_the_registered_names(policy):
    with pytest.raises(ConfigError, match=r"EntMTPConfig\.policy: must be one of \['static', .*'entropy'\]") as err:
        EntMTPConfig(tree=[[0]], policy=policy) if policy is not None else get_policy(None, "EntMTPConfig.policy")
    assert err.value.field == "EntMTPConfig.policy"


def test_a_scheduler_takes_only_its_policys_arguments():
    with pytest.raises(ConfigError, match=r"the static policy takes \['static_index'\], not \['tau_on'\]"):
        Scheduler("static", num_trees=2, tau_on=0.5)
    with pytest.raises(ConfigError, match="Scheduler.num_trees"):
        Scheduler("static", num_trees=0)


def test_registering_a_policy_makes_every_reader_accept_it(registry):
    register_policy(
        "above",
        AboveRule,
        needs=NEEDS_FEATURE,
        aliases=("over",),
        sources=("bank", "trees"),
        what="picks among several trees",
        from_bank=lambda d, trees: ((d.static, d.aggressive), {}),
    )
    assert "above" in policy_names() and "above" in policies.POLICIES and "above" in policies.FEATURE_POLICIES
    s = Scheduler("over", num_trees=2, level=0.3)  # the alias names it too
    assert [s.choose(x) for x in (0.1, 0.4, 0.2)] == [0, 1, 0] and s.needs_feature
    plan = EntMTPConfig(trees=TREES, policy="above").resolve(4)
    assert plan.policy == "above" and plan.scheduler_args == {"policy": "above"} and plan.chain_nodes
    with pytest.raises(ConfigError, match="the above policy picks among several trees: pass a `bank` or `trees=`"):
        EntMTPConfig(tree=CHAIN, policy="above")
    bank = TopologyBank("t", [Tree.chain(1), Tree.chain(2)], {"scheduler": {"policy": "above", "static": 0}})
    assert bank.scheduler.policy == "above"
    assert EntMTPConfig(bank=bank, task="t").resolve(4).trees == (Tree.chain(1), Tree.chain(2))


def test_a_name_or_alias_registered_already_is_refused(registry):
    for name, aliases in (("static", ()), ("mine", ("EntMTP*",)), ("", ())):
        with pytest.raises(ValueError, match="is taken"):
            register_policy(name, AboveRule, needs=NEEDS_FEATURE, aliases=aliases)
    with pytest.raises(ValueError, match="needs one of"):
        register_policy("mine", AboveRule, needs="the weather")

    @dataclass
    class NoDefault:
        num_trees: int
        level: float

    with pytest.raises(ValueError, match="needs a default"):
        register_policy("mine", NoDefault, needs=NEEDS_FEATURE)
    assert "mine" not in policy_names()


def test_a_registered_policy_decodes_losslessly(tiny_cache, registry):
    """The drafter dispatches on what a policy reads, not on its name: a new feature policy
    switches trees in generate, and greedy output stays the base model's."""
    register_policy("above", AboveRule, needs=NEEDS_FEATURE, sources=("trees",))
    model = enabled(tiny_cache)
    chosen = set()
    for ids in prompts():
        plain = model.generate(ids, max_new_tokens=30, do_sample=False)
        # the tiny models' top-1 probabilities lie around 0.06-0.14: 0.1 uses both trees
        cfg = EntMTPConfig(trees=[[[0]], [[0], [0, 0], [1]]], policy="above", feature="base_top1")
        out = model.generate(ids, max_new_tokens=30, do_sample=False, entmtp_config=cfg, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain)
        chosen.update(out.entmtp_stats["tree_indices"])
    assert chosen == {0, 1}
