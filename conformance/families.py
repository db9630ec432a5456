"""The model families of the conformance matrix: KerasHub models built tiny from their config, and their data.

Every family is a KerasHub task model (or a backbone with a small head where
KerasHub has no task for it) with dropout off (a strategy draws other random
numbers than one device, by design), built from config: nothing is downloaded.
Sizes are the smallest that keep each family's structure (attention heads and
key/value heads that a 4-way model axis divides, at least one of each block
type, experts that route).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

VOCAB, SEQ, HIDDEN, HEADS, KV_HEADS, FFN, CLASSES = 64, 8, 16, 4, 2, 32, 3
IMAGE = (16, 16, 3)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: how to build a tiny model and the data it trains on.

    Attributes:
        name: the family's name in the matrix (KerasHub's, lower case).
        kind: "causal_lm", "classifier" (text), "seq2seq" or "image".
        model: builds the uncompiled model (no arguments).
        layout_map: KerasHub's own `get_layout_map` for the family's backbone, or None where it has none.
        batch_statistics: what the model computes from the batch in training ("batch_norm",
            "moe_balancing"), or None.
        segments: whether the text model takes `segment_ids`.
        aux_loss: the backbone's argument that scales its router's load-balancing loss (an MoE), or None.
    """

    name: str
    kind: str
    model: Callable
    layout_map: Callable | None = None
    batch_statistics: str | None = None
    segments: bool = False
    aux_loss: str | None = None

    def build(self, *, aux_loss: bool = True):
        """The uncompiled model; `aux_loss=False` builds an MoE with its load-balancing loss scaled by 0."""
        if aux_loss:
            return self.model()
        if self.aux_loss is None:
            raise ValueError(f"family {self.name!r} has no load-balancing loss to turn off (aux_loss is None)")
        return self.model(**{self.aux_loss: 0.0})

    def data(self, examples: int, seed: int = 0):
        """`(x, y)` of `examples` synthetic examples for this family (a few padded tokens for text)."""
        rng = np.random.default_rng(seed)
        if self.kind == "image":
            images = rng.normal(size=(examples, *IMAGE)).astype("float32")
            return images, rng.integers(0, CLASSES, examples).astype("int32")
        ids = rng.integers(1, VOCAB, (examples, SEQ)).astype("int32")
        mask = np.ones_like(ids)
        mask[::3, SEQ - 2 :] = 0  # every third sequence ends in padding
        if self.kind == "seq2seq":
            x = {"encoder_token_ids": ids, "encoder_padding_mask": mask,
                 "decoder_token_ids": np.roll(ids, 1, axis=1), "decoder_padding_mask": mask}
            return x, ids
        x = {"token_ids": ids, "padding_mask": mask}
        if self.segments:
            x["segment_ids"] = np.zeros_like(ids)
        if self.kind == "classifier":
            return x, rng.integers(0, CLASSES, examples).astype("int32")
        return x, np.roll(ids, -1, axis=1)


def _hub():
    import keras_hub

    return keras_hub.models


def _causal(task: str, backbone: str, **config) -> Callable:
    def build(**overrides):
        models = _hub()
        return getattr(models, task)(
            backbone=getattr(models, backbone)(vocabulary_size=VOCAB, **{**config, **overrides}), preprocessor=None
        )

    return build


def _classifier(task: str, backbone: str, *, vocabulary="vocabulary_size", **config) -> Callable:
    def build():
        models = _hub()
        backbone_model = getattr(models, backbone)(**{vocabulary: VOCAB}, **config)
        return getattr(models, task)(backbone=backbone_model, num_classes=CLASSES, preprocessor=None, dropout=0.0)

    return build


def _electra():
    """ELECTRA has no classifier task in KerasHub: its backbone's pooled output and a Dense head."""
    import keras

    backbone = _hub().ElectraBackbone(
        vocab_size=VOCAB, num_layers=1, num_heads=HEADS, hidden_dim=HIDDEN, embedding_dim=8, intermediate_dim=FFN,
        dropout=0.0, max_sequence_length=SEQ,
    )
    inputs = {name: keras.Input((SEQ,), dtype="int32", name=name) for name in ("token_ids", "segment_ids",
                                                                               "padding_mask")}
    pooled = backbone(inputs)["pooled_output"]
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(pooled), name="electra_classifier")


def _image(task: str, backbone: Callable) -> Callable:
    def build():
        return getattr(_hub(), task)(backbone=backbone(), num_classes=CLASSES, preprocessor=None)

    return build


def _resnet():
    return _hub().ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64], stackwise_num_blocks=[1],
        stackwise_num_strides=[1], block_type="basic_block", image_shape=IMAGE,
    )


def _efficientnet():
    return _hub().EfficientNetBackbone(
        stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1], stackwise_input_filters=[8, 8],
        stackwise_output_filters=[8, 16], stackwise_expansion_ratios=[1, 4], stackwise_squeeze_and_excite_ratios=[0.0,
        0.25], stackwise_strides=[1, 2], stackwise_block_types=["fused", "unfused"],
        stackwise_force_input_filters=[0, 0], stackwise_nores_option=[False, False], width_coefficient=1.0,
        depth_coefficient=1.0, dropout=0.0, input_shape=IMAGE, num_features=32,
    )


def _densenet():
    return _hub().DenseNetBackbone(stackwise_num_repeats=[1, 1], image_shape=IMAGE, growth_rate=8)


def _vit():
    return _hub().ViTBackbone(image_shape=IMAGE, patch_size=4, num_layers=1, num_heads=HEADS, hidden_dim=HIDDEN,
                              mlp_dim=FFN)


def _vgg():
    # One block: its pooled 8 x 8 map still fits the classifier head's 7 x 7 convolution.
    return _hub().VGGBackbone(stackwise_num_repeats=[1], stackwise_num_filters=[8], image_shape=IMAGE)


def _vgg_classifier():
    return _hub().VGGImageClassifier(backbone=_vgg(), num_classes=CLASSES, preprocessor=None, pooling="avg",
                                     pooling_hidden_dim=16)


def _t5():
    backbone = _hub().T5Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=HEADS, hidden_dim=HIDDEN,
                                 intermediate_dim=FFN, key_value_dim=4, dropout=0.0)
    return _hub().T5Seq2SeqLM(backbone=backbone, preprocessor=None)


def _layout_map(backbone: str) -> Callable:
    def get(device_mesh):
        return getattr(_hub(), backbone).get_layout_map(device_mesh)

    return get


_DECODER = {"num_layers": 1, "hidden_dim": HIDDEN, "intermediate_dim": FFN}
_GQA = {**_DECODER, "num_query_heads": HEADS, "num_key_value_heads": KV_HEADS}
_ENCODER = {"num_layers": 1, "num_heads": HEADS, "hidden_dim": HIDDEN, "intermediate_dim": FFN, "dropout": 0.0,
            "max_sequence_length": SEQ}
_EXPERTS = {"num_experts": 4, "top_k": 2}

FAMILIES = {f.name: f for f in (
    Family("gpt2", "causal_lm", _causal("GPT2CausalLM", "GPT2Backbone", num_heads=HEADS, dropout=0.0,
                                        max_sequence_length=SEQ, **_DECODER)),
    Family("gpt_neo_x", "causal_lm", _causal("GPTNeoXCausalLM", "GPTNeoXBackbone", num_heads=HEADS, dropout=0.0,
                                             rotary_percentage=0.5, max_sequence_length=SEQ, **_DECODER)),
    Family("llama", "causal_lm", _causal("LlamaCausalLM", "LlamaBackbone", **_GQA), _layout_map("LlamaBackbone")),
    Family("llama3", "causal_lm", _causal("Llama3CausalLM", "Llama3Backbone", **_GQA), _layout_map("Llama3Backbone")),
    Family("mistral", "causal_lm", _causal("MistralCausalLM", "MistralBackbone", **_GQA)),
    Family("mixtral", "causal_lm", _causal("MixtralCausalLM", "MixtralBackbone", **_GQA, **_EXPERTS),
           batch_statistics="moe_balancing", aux_loss="router_aux_loss_coef"),
    # KerasHub's Gemma layout map splits the key/value heads over "model": 4 of them, as many as query heads.
    Family("gemma", "causal_lm", _causal("GemmaCausalLM", "GemmaBackbone", head_dim=4,
                                         **{**_GQA, "num_key_value_heads": HEADS}), _layout_map("GemmaBackbone")),
    Family("gemma3", "causal_lm", _causal("Gemma3CausalLM", "Gemma3Backbone", image_size=16, head_dim=4,
                                          vision_encoder=None, **_GQA)),
    Family("qwen", "causal_lm", _causal("QwenCausalLM", "QwenBackbone", **_GQA), _layout_map("QwenBackbone")),
    Family("qwen3", "causal_lm", _causal("Qwen3CausalLM", "Qwen3Backbone", head_dim=4, **_GQA)),
    Family("qwen_moe", "causal_lm", _causal("QwenMoeCausalLM", "QwenMoeBackbone", moe_intermediate_dim=16,
                                            shared_expert_intermediate_dim=FFN, **_GQA, **_EXPERTS),
           _layout_map("QwenMoeBackbone"), batch_statistics="moe_balancing", aux_loss="router_aux_loss_coefficient"),
    Family("qwen3_moe", "causal_lm", _causal("Qwen3MoeCausalLM", "Qwen3MoeBackbone", moe_intermediate_dim=16,
                                             head_dim=4, **_GQA, **_EXPERTS),
           _layout_map("Qwen3MoeBackbone"), batch_statistics="moe_balancing",
           aux_loss="router_aux_loss_coefficient"),
    Family("gpt_oss", "causal_lm", _causal("GptOssCausalLM", "GptOssBackbone", head_dim=4, **_GQA, **_EXPERTS)),
    Family("phi3", "causal_lm", _causal("Phi3CausalLM", "Phi3Backbone", max_sequence_length=SEQ,
                                        pretraining_sequence_length=SEQ, **_GQA)),
    Family("falcon", "causal_lm", _causal("FalconCausalLM", "FalconBackbone", num_attention_heads=HEADS,
                                          **_DECODER)),
    Family("opt", "causal_lm", _causal("OPTCausalLM", "OPTBackbone", num_heads=HEADS, dropout=0.0,
                                       max_sequence_length=SEQ, **_DECODER)),
    Family("bloom", "causal_lm", _causal("BloomCausalLM", "BloomBackbone", num_heads=HEADS, dropout=0.0, **_DECODER)),
    Family("bert", "classifier", _classifier("BertTextClassifier", "BertBackbone", **_ENCODER),
           segments=True),
    Family("roberta", "classifier", _classifier("RobertaTextClassifier", "RobertaBackbone", **_ENCODER)),
    Family("xlm_roberta", "classifier", _classifier("XLMRobertaTextClassifier", "XLMRobertaBackbone", **_ENCODER)),
    Family("distil_bert", "classifier", _classifier("DistilBertTextClassifier", "DistilBertBackbone", **_ENCODER)),
    Family("albert", "classifier", _classifier("AlbertTextClassifier", "AlbertBackbone", embedding_dim=8,
                                               **_ENCODER), segments=True),
    Family("electra", "classifier", _electra, segments=True),
    Family("deberta_v3", "classifier", _classifier("DebertaV3TextClassifier", "DebertaV3Backbone", bucket_size=4,
                                                   **_ENCODER)),
    Family("t5", "seq2seq", _t5),
    Family("vit", "image", _image("ViTImageClassifier", _vit)),
    Family("resnet", "image", _image("ResNetImageClassifier", _resnet), batch_statistics="batch_norm"),
    Family("efficientnet", "image", _image("EfficientNetImageClassifier", _efficientnet),
           batch_statistics="batch_norm"),
    Family("densenet", "image", _image("DenseNetImageClassifier", _densenet), batch_statistics="batch_norm"),
    Family("vgg", "image", _vgg_classifier),
)}
"""Every family of the matrix, by name, in the matrix's order."""
