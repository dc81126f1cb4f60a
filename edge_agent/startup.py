"""What an agent sets up once per device and data version (docs/architecture.md, steps 1
and 2): the backbones' runtime, the training split's cached features with their labels and
data version, the test split's evaluator, and the head's starting weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from edge_agent import data as data_mod
from edge_agent.config import AgentConfig
from edge_agent.evaluation import Evaluator
from edge_agent.features import FeatureCache, cache_features, fingerprint, with_cache_dir
from edge_agent.state import StateDir
from edge_agent.train import LocalModel
from export import bundle as bundle_mod
from export.runtime import BackboneRuntime

log = logging.getLogger(__name__)


def open_runtime(cfg: AgentConfig, state: StateDir) -> BackboneRuntime:
    """The configured bundle's backbones, with their engine caches in the state folder."""
    bundle = bundle_mod.load(cfg.bundle)  # refuses files that do not match their hashes
    return BackboneRuntime(bundle, settings=with_cache_dir(cfg.runtime, state.providers_dir))


@dataclass(frozen=True)
class TrainingData:
    features: np.ndarray  # (N, K*d_e) cached backbone features
    labels: np.ndarray  # (N,) indices into the fleet's classes
    version: str  # what the data is: a once-per-data-version release belongs to it
    evaluator: Evaluator | None  # the test split's, if the configuration names one


def load_training_data(
    cfg: AgentConfig, runtime: BackboneRuntime, state: StateDir, *, evaluator: type[Evaluator]
) -> TrainingData:
    """The training split's features (cached: the backbones never run again on the same
    sample), refused above ``privacy.dataset_size``; ``evaluator`` scores the test split."""
    cache = FeatureCache(
        cfg.data.feature_cache or state.cache_dir, shared=cfg.data.shared_feature_cache
    )
    bundle_id = runtime.bundle.id
    # Only the labels outlive this: the backbones are done with the images once their
    # features are cached, and a large data set's pixels (12 kB a sample at 32 x 32)
    # would otherwise sit in a small device's memory for the agent's whole life.
    train = data_mod.load(cfg.data.train, cfg.classes, size=cfg.data.image_size)
    bound = cfg.privacy.dataset_size
    if bound is not None and len(train) > bound:
        raise data_mod.DataError(
            f"{cfg.data.train}: {len(train)} training samples, above privacy.dataset_size "
            f"= {bound}, the public bound the privacy plan is computed "
            "from: raise dataset_size (and re-plan with `edge-agent privacy-plan`) or "
            "hold fewer samples"
        )
    version = fingerprint(train.images, train.labels)
    features = cache_features(cache, bundle_id, train, runtime, what="training data")
    labels = train.labels
    del train
    # Scored after every round on a labelled test split, if the configuration names one.
    scorer = evaluator.for_test_split(
        cfg, load=lambda d: cache_features(cache, bundle_id, d, runtime, what="test data")
    )
    cache.prune(keep_bundle=bundle_id)
    if not cache.shared:
        # What the data was before it changed: its rows are copied by now.
        for name in cache.drop_unserved():
            log.info("feature cache: dropped %s (superseded data)", name)
    return TrainingData(features=features, labels=labels, version=version, evaluator=scorer)


def new_head(cfg: AgentConfig, *, in_dim: int, dual: bool) -> LocalModel:
    """The head's starting weights, drawn from ``init_seed`` (else ``seed``) without
    touching the process's own random state."""
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed if cfg.init_seed is None else cfg.init_seed)
        return LocalModel(in_dim=in_dim, num_classes=len(cfg.classes), cfg=cfg.train, dual=dual)
