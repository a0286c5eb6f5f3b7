"""Model geometry presets. `tiny` is a random H3 small enough for CPU tests; `full` is the released geometry.

The dicts are the diffusers / transformers config fields, so the same values build diffusers' reference classes
(our numerical oracle) and our own modules.
"""

from __future__ import annotations

import copy

# The released MiniMax H3 (H3_REFERENCE §1.2): 56 heads x 128, width 5376, 50 layers.
FULL_TRANSFORMER = dict(
    num_attention_heads=56, attention_head_dim=128, hidden_size=5376, num_layers=50, num_refiner_layers=2,
    ffn_dim=14336, in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=5120, freq_dim=256,
    time_embed_hidden_dim=5376, time_embed_dim=2688, rope_freq_dim=16, rope_theta=10000.0,
    norm_eps=1e-5, qk_norm_eps=1e-5, final_norm_eps=1e-5,
)

TINY_TRANSFORMER = dict(
    FULL_TRANSFORMER,
    num_attention_heads=2, attention_head_dim=32, hidden_size=64, num_layers=2, num_refiner_layers=2,
    ffn_dim=128, text_dim=64, freq_dim=16, time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=4,
)

TINY_VIDEO_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=24, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2, 2), temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4,
    decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=16,
    decoder_num_register_tokens=4, decoder_ffn_mult=4,
    latents_mean=[0.02 * i - 0.2 for i in range(24)], latents_std=[0.5 + 0.05 * i for i in range(24)],
)

TINY_AUDIO_VAE = dict(
    encoder_dim=4, encoder_rates=(8, 10, 10), latent_dim=64, latent_channels=32, num_attention_heads=2,
    decoder_dim=16, decoder_rates=(10, 10, 8), decoder_kernel_sizes=(20, 20, 16), resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1,),), sampling_rate=32000,
    latents_mean=[0.01 * i for i in range(32)], latents_std=[1.0 + 0.02 * i for i in range(32)],
)

# Qwen3-VL text + vision configs, in transformers 5.x field names (`Qwen3VLTextConfig` / `Qwen3VLVisionConfig`).
# transformers 5 keeps the rotary settings in one `rope_parameters` dict (rope_type, rope_theta, mrope_section,
# mrope_interleaved); the 4.x spelling `rope_theta=` + `rope_scaling=` is only accepted as a legacy alias.
# `vocab_size` and the vision token ids come from the tokenizer the checkpoint is built with.
# >= 51 text layers: the DiT reads hidden_states[50], and diffusers refuses a conditioner with 50 or fewer layers.
TINY_TEXT_ENCODER_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=51, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [6, 5, 5],
                     "mrope_interleaved": True},
    rms_norm_eps=1e-6, max_position_embeddings=8192, hidden_act="silu",
)
TINY_TEXT_ENCODER_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=2304, deepstack_visual_indexes=[0],
)

# Released geometries of the other components (H3_REFERENCE §1.3, §1.4, §1.6). The VAEs are the diffusers class
# defaults; their `latents_mean` / `latents_std` (released values unknown here) stay at the class defaults.
FULL_VIDEO_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=24, block_out_channels=(128, 256, 256, 512, 512, 1024),
    layers_per_block=2, spatial_downsample_factors=(2, 2, 2, 2, 1, 1), temporal_downsample_factors=(1, 2, 2, 1, 1, 1),
    norm_num_groups=32, norm_eps=1e-6, spatial_padding_mode="reflect", decoder_num_layers=36,
    decoder_num_attention_heads=32, decoder_attention_head_dim=64, decoder_num_register_tokens=4, decoder_ffn_mult=4,
    decoder_rope_theta=100.0, decoder_rope_dim_ratio=0.75, decoder_norm_eps=1e-5, clip_length=17, token_drop=3,
)

FULL_AUDIO_VAE = dict(
    encoder_dim=64, encoder_rates=(2, 4, 4, 5, 5), latent_dim=2048, latent_channels=32, num_attention_heads=8,
    decoder_dim=1024, decoder_rates=(5, 5, 2, 2, 2, 2, 2), decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
    resblock_kernel_sizes=(3, 7, 11), resblock_dilation_sizes=((1, 3, 5), (1, 3, 5), (1, 3, 5)), sampling_rate=32000,
    # The class default is None, which neither the reference pipeline nor ours can decode with; the released values
    # are unknown here, so the random checkpoint uses the identity normalization.
    latents_mean=[0.0] * 32, latents_std=[1.0] * 32,
)

# Qwen3-VL-32B. `vocab_size` is the release's (151,936 embedding rows); the vision token ids still come from the
# tokenizer the checkpoint is built with.
FULL_TEXT_ENCODER_TEXT = dict(
    vocab_size=151_936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
    num_key_value_heads=8, head_dim=128,
    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                     "mrope_interleaved": True},
    rms_norm_eps=1e-6, max_position_embeddings=262_144, hidden_act="silu",
)
FULL_TEXT_ENCODER_VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=5120, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
)

# `tiny8`: the tiny model with head counts that allow degree 8 everywhere (DiT Ulysses 8; encoder TP 8 with one KV
# head per rank), for dry runs of the 8-GPU layout on CPU ranks. Everything else is `tiny`.
TINY8_TRANSFORMER = dict(TINY_TRANSFORMER, num_attention_heads=8)
TINY8_TEXT_ENCODER_TEXT = dict(TINY_TEXT_ENCODER_TEXT, num_attention_heads=8, num_key_value_heads=8)

SCHEDULER_SHIFTS = {"scheduler": 12.0, "audio_scheduler": 3.0}

# Hidden state the DiT reads from the text encoder: index 50 of hidden_states (= output of decoder layer 49).
TEXT_ENCODER_LAYER = 50

PRESETS = {"tiny", "tiny8", "full"}
CHECKPOINT_PRESETS = ("tiny", "tiny8", "full")   # what `h3serve checkpoint init` builds


def transformer_config(preset: str) -> dict:
    return copy.deepcopy({"tiny": TINY_TRANSFORMER, "tiny8": TINY8_TRANSFORMER, "full": FULL_TRANSFORMER}[preset])


def text_encoder_text_config(preset: str) -> dict:
    return copy.deepcopy({"tiny": TINY_TEXT_ENCODER_TEXT, "tiny8": TINY8_TEXT_ENCODER_TEXT,
                          "full": FULL_TEXT_ENCODER_TEXT}[preset])


def text_encoder_vision_config(preset: str) -> dict:
    return copy.deepcopy({"tiny": TINY_TEXT_ENCODER_VISION, "tiny8": TINY_TEXT_ENCODER_VISION,
                          "full": FULL_TEXT_ENCODER_VISION}[preset])


def video_vae_config(preset: str) -> dict:
    return copy.deepcopy({"tiny": TINY_VIDEO_VAE, "tiny8": TINY_VIDEO_VAE, "full": FULL_VIDEO_VAE}[preset])


def audio_vae_config(preset: str) -> dict:
    return copy.deepcopy({"tiny": TINY_AUDIO_VAE, "tiny8": TINY_AUDIO_VAE, "full": FULL_AUDIO_VAE}[preset])
