"""tokenmill as a Ray Data stage: ``ray.data.llm``'s processor API over tokenmill engines.

    import ray
    from tokenmill.ray import TokenmillProcessorConfig, build_llm_processor

    config = TokenmillProcessorConfig(model_source="smollm2-135m-instruct", concurrency=2, batch_size=64)
    processor = build_llm_processor(
        config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["text"]}],
                                    sampling_params=dict(temperature=0.3, max_tokens=64)),
        postprocess=lambda row: dict(answer=row["generated_text"], **row),
    )
    ds = processor(ray.data.read_json("s3://bucket/prompts/"))

Needs the ``ray`` extra (``pip install 'tokenmill[ray]'``); importing this package does not import
ray, building a processor does. See docs/scale-out.md.
"""

from tokenmill.ray.config import TokenmillProcessorConfig
from tokenmill.ray.processor import Processor, build_llm_processor

__all__ = ["Processor", "TokenmillProcessorConfig", "build_llm_processor"]
