"""How much each backbone of a bundle contributes to a trained fleet's prototypes (FedPCL
Fig. 3's question), answered from every device's trained head and cached features."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edge_agent import data as data_mod
from edge_agent.config import load as load_agent_config
from edge_agent.features import FeatureCache, cache_features
from edge_agent.head import local_prototypes
from edge_agent.methods import device_method
from edge_agent.state import StateDir
from edge_agent.train import LocalModel, embed
from export.runtime import BackboneRuntime
from fleet.transports.spec import RunResult
from runtime.cliutil import CommandFailed


def backbone_contribution(
    result: RunResult, bundle: Path
) -> tuple[list[str], list[str], np.ndarray]:
    """FedPCL Fig. 3's question, answered with the trained heads: for each domain and
    backbone k, the cosine similarity between a client's class prototypes computed from
    all backbones and those computed from backbone k alone (the other backbones' feature
    blocks replaced by their mean over the client's data, which keeps the head's input
    in distribution), averaged over classes and over the domain's clients."""
    runtime = BackboneRuntime(bundle)
    members = runtime.bundle.members
    names = [m.name for m in members]
    bounds = np.cumsum([0] + [m.output_dim for m in members])
    sims: dict[str, list[np.ndarray]] = {}
    for client in result.clients:
        # What the device kept: its trained head and the features of its training data
        # (from the run's feature cache), read without starting an agent.
        cfg = load_agent_config(result.spec.layout.agent_config(client.name))
        state = StateDir(cfg.state_dir, agent_id=cfg.agent_id, create=False)
        n_cls = len(cfg.classes)
        model = LocalModel(in_dim=runtime.feature_dim, num_classes=n_cls, cfg=cfg.train,
                           dual=device_method(cfg.method).dual)  # fmt: skip
        if not state.load_model(model):
            raise CommandFailed(f"{client.name}: no trained head in {cfg.state_dir}")
        train = data_mod.load(cfg.data.train, cfg.classes, size=cfg.data.image_size)
        cache = FeatureCache(
            cfg.data.feature_cache or state.cache_dir, shared=cfg.data.shared_feature_cache
        )
        feats = np.asarray(
            cache_features(cache, runtime.bundle.id, train, runtime, what="training data"),
            dtype=np.float32,
        )
        labels = torch.from_numpy(train.labels)
        full, counts = local_prototypes(torch.from_numpy(embed(model, feats)[0]), labels, n_cls)
        present = (counts > 0).numpy()
        row = []
        for k in range(len(members)):
            only = np.broadcast_to(feats.mean(0), feats.shape).copy()
            only[:, bounds[k] : bounds[k + 1]] = feats[:, bounds[k] : bounds[k + 1]]
            single, _ = local_prototypes(torch.from_numpy(embed(model, only)[0]), labels, n_cls)
            cos = torch.nn.functional.cosine_similarity(single, full, dim=1).numpy()
            row.append(float(cos[present].mean()))
        sims.setdefault(client.domain, []).append(np.array(row))
    domains = sorted(sims)
    return domains, names, np.stack([np.mean(sims[d], axis=0) for d in domains])
