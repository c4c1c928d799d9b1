"""How pricing counts: `PricingSettings` (the deployment's knobs) and `Rules` (those plus the
per-model tables a walk consults)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from classifiers.bymodel import ByModel
from classifiers.images import ImageRule
from classifiers.media_urls import MediaUrls


@dataclass(frozen=True)
class PricingSettings:
    """Token constants of the counting rules, bounds on hostile input, and the encode pool's shape."""

    per_message_tokens: int = 3
    per_name_tokens: int = 1
    reply_priming_tokens: int = 3
    per_tool_call_tokens: int = 3
    tools_overhead_tokens: int = 9
    image_tokens: int = 765
    audio_tokens: int = 1000
    video_tokens: int = 4096
    file_tokens: int = 4096
    # A Responses API `item_reference` names an item stored on the server; its size is unknown here.
    item_reference_tokens: int = 16
    # A Responses request whose server adds what the body does not show (stored history or prompt,
    # item references, the turns of built-in tools) holds the model's whole context instead of what
    # is visible: sound for untrusted tenants on an engine with its response store or tool server on
    # (vLLM: VLLM_ENABLE_RESPONSES_API_STORE=1, --tool-server), at the price of reserving that much.
    server_state_at_context: bool = False
    # Work an engine does on every decode step of a request, beside everyone else's: each `stop`
    # string is searched for in the new text (in vLLM's API server, whose one loop streams every
    # request), each `logit_bias` entry applied to the logits. OpenAI allows 4 stop sequences; these
    # bounds are looser, so no OpenAI client is refused. 0: no bound.
    max_stop_sequences: int = 16
    max_stop_chars: int = 1024
    max_logit_bias: int = 1024
    # Token-id lists an engine copies into fixed-width rows of its sampler state: vLLM's GPU model
    # runner sizes them at 128 stop token ids and 1,024 allowed token ids (and logit_bias entries),
    # and one request above a row's width raised inside the engine loop, which shut the engine down
    # for every request on it (vLLM PR #55164). 0: no bound.
    max_stop_token_ids: int = 128
    max_allowed_token_ids: int = 1024
    # Prompt log-probabilities only for prompts of at most this many tokens (validation.py: the
    # engine's full-vocabulary logits of the prompt are a memory spike outside its KV cache, ~1.9
    # GiB at 2,048 tokens of a 152k vocabulary). 0: no bound.
    max_prompt_logprobs_tokens: int = 2048
    # Pixels of one image whose size the request shows (a data: URL's PNG, JPEG, GIF or WebP header):
    # an engine decodes all of them before it resizes (3-4 bytes each, in its API server, while the
    # KV cost is capped by the model's max_pixels): 20,000 x 20,000 is 1.2 GB from a few hundred KB
    # of PNG. Default: Pillow's own decompression-bomb warning threshold. 0: no bound.
    max_image_pixels: int = 89_478_485
    # Elements a request may hold: chat messages and their content parts, completions prompts and
    # embeddings inputs (strings or token-id arrays), Responses input items and their parts. Pricing
    # walks each one on the event loop (~3 us each): 100,000 tiny ones, 4 MB, stalled the loop for
    # 0.1-0.2 s per request; 10,000 for 20-35 ms. OpenAI allows 2,048 embeddings inputs. 0: no bound.
    max_items: int = 10_000
    # Off the event loop (Pricer.aprice_*): a request's texts are tokenized inline while they total
    # at most this many characters; beyond that, texts the tokenizer has not memoised go to the
    # encode pool. 8192 characters of prose are ~0.4 ms of tiktoken, about what the gateway spends
    # on a request anyway, so no request stalls the loop for much longer than its own handling.
    inline_max_chars: int = 8192
    # Threads of the encode pool; 0 encodes everything inline, on the caller's thread.
    encode_threads: int = 2
    # How much lower the encode threads' CPU priority is than the event loop's (a Linux nice
    # increment; 0 keeps them equal): on a busy machine tokenizing long prompts waits for the CPU,
    # serving requests does not.
    encode_nice: int = 10
    # Linux: run the encode threads under SCHED_IDLE as well, so they get a core only when nothing
    # else wants it. A nice increment alone still let them take scheduler slices of a few ms from
    # the loop on a busy 2-core machine: short requests' added p99 3.5 ms instead of 0.8 ms while 20
    # never-seen 28k-token prompts/s were priced (docs/benchmarks.md); the long prompts pay instead.
    # The price of that: while the gateway's own cores are saturated (its CPU limit, say) an idle
    # thread gets ~0.3 % of a core, so a long prompt's pricing can take seconds; `false` keeps only
    # the nice increment (~10 %), for a deployment that prefers long prompts to wait less.
    encode_idle: bool = True
    # Estimate mode (estimate.py): a request whose texts left to encode total at least this many
    # characters is priced at once on a learned tokens-per-character ratio plus the margin, while
    # the exact count is made off the loop and corrects the lease when it arrives. 0: always exact.
    estimate_above_chars: int = 0
    estimate_margin_percent: int = 10
    # The URLs a media part may make the engine fetch from inside its network (classifiers/media_urls.py):
    # by default data: and http(s) URLs of public hosts; never paths, other schemes, private addresses.
    media_urls: MediaUrls = field(default_factory=MediaUrls)


@dataclass(frozen=True, slots=True)
class Rules:
    """What a walk prices by: the settings, and what each model's images cost and which token ids
    it has. Built once per `Pricer`; the walkers get this, not the pricer."""

    settings: PricingSettings
    # Image cost by model glob, first match wins; other models' images cost settings.image_tokens.
    images: ByModel[ImageRule]
    # Vocabulary size by model glob; a matching model's requests carry token ids below it.
    vocab: ByModel[int | None]
    # Chat content parts (other than text and refusal) and what each costs, in the order an error
    # lists them.
    part_constants: Mapping[str, int]

    @classmethod
    def of(
        cls,
        settings: PricingSettings,
        images: Sequence[tuple[str, ImageRule]] = (),
        vocab_sizes: Sequence[tuple[str, int]] = (),
    ) -> Rules:
        return cls(
            settings=settings,
            images=ByModel(images, ImageRule(tokens=settings.image_tokens)),
            vocab=ByModel(vocab_sizes, None),
            part_constants={
                "image_url": settings.image_tokens,
                "input_audio": settings.audio_tokens,
                "audio_url": settings.audio_tokens,
                "video_url": settings.video_tokens,
                "file": settings.file_tokens,
            },
        )
