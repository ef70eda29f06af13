"""Runs an unmodified Hugging Face training script with tierlift.zero sharding (see route.py).

    torchrun --nproc-per-node 8 -m tierlift.hf.launch --config zero.json run_clm.py [ARGS...]
    TIERLIFT_HF_CONFIG=zero.json torchrun --nproc-per-node 8 -m tierlift.hf.launch -m MODULE ...
"""

from tierlift.hf.route import main

if __name__ == "__main__":
    main()
