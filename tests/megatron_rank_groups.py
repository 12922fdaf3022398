"""Process-group rank lists produced by Megatron-Core's ``RankGenerator``, as literal test data.

Source: NVIDIA/Megatron-LM, commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22),
file ``megatron/core/parallel_state.py``: ``generate_masked_orthogonal_rank_groups``,
``RankGenerator`` (``__init__``, ``get_mask``, ``get_ranks``) and ``_inject_gtp_remat_axis``, with the
generators built the way ``initialize_model_parallel`` builds them (default ``order="tp-cp-ep-dp-pp"``,
``gtp_remat_size = expert_gtp_remat_size = 1``, ``rank_offset = 0``). Those functions were run
unchanged, and every list below is exactly what ``get_ranks(token)`` returned. No Megatron code is
included here; this module holds only the output.

Dense (decoder) generator::

    dp = world // (tp * pp * cp)
    RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-gtp_remat-cp-ep-dp-pp", gtp_remat=1)

Expert generator (MoE parallel folding: the expert grid covers the same ranks as the dense grid)::

    edp = world // (etp * ep * pp)      # expert data parallel size; world % (etp*ep*pp) must be 0
    RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-gtp_remat-dp-pp", gtp_remat=1)

``_inject_gtp_remat_axis`` adds the ``gtp_remat`` axis to ``order`` (after ``tp`` for the dense grid,
after ``ep`` for the expert grid). With its size 1 it changes nothing: the same lists come out of
``order="tp-cp-ep-dp-pp"`` for both generators, and of the ``RankGenerator`` in megatron-core 0.16.1
(PyPI), which has no such axis. The expert generator has no context parallelism (``cp=1``): each
pipeline stage's tp * cp * dp ranks are split again into etp * ep * edp. The only size check is
``world % (etp * ep * pp) == 0``. Because world = tp * cp * dp * pp, that means ``etp * ep`` must
divide ``tp * cp * dp``. Nothing requires ``ep <= dp`` or ``ep`` to divide the dense dp (layouts C and F
have ep > dp). The other checks ``initialize_model_parallel`` makes pass for every layout here: the
dense and expert ``"pp"`` groups are equal, and ``order.endswith("pp")`` (without it, the dense and
expert dp sizes would have to match when pp > 1).

How ``get_ranks`` reads a token: it marks the named axes and returns one group for each combination
of the other axes. Only which axes are named matters, not the order they are written in
(``"cp-dp"`` gives the same lists as ``"dp-cp"``). Inside a group, ranks follow the generator's
order string, with the leftmost axis (``tp``) changing fastest. Groups are listed with the leftmost
unmarked axis changing fastest. An axis of size 1 gives singleton groups (for example, ``"cp"`` when
cp = 1).

Tokens and the Megatron groups they build (``initialize_model_parallel`` at that commit):

dense:  "tp" tensor model parallel; "cp" context parallel; "dp" data parallel; "dp-cp" data
        parallel with cp; "pp" pipeline (and the embedding groups taken from it); "tp-pp" model
        parallel (Megatron passes "tp-gtp_remat-pp", which gives the same lists here); "tp-cp"
        tensor and context parallel; "tp-dp-cp" tensor and data parallel with cp (Megatron passes
        "tp-gtp_remat-dp-cp", which gives the same lists here).
expert: "tp" expert tensor parallel; "ep" expert model parallel; "dp" expert data parallel;
        "tp-ep" expert tensor and model parallel; "tp-ep-pp" expert tensor, model and pipeline
        parallel; "pp" pipeline (checked against the dense "pp").
"""

LAYOUTS = {
    # world 8: dense tp 2 x cp 1 x dp 2 x pp 2; expert etp 1 x ep 1 x edp 4 x pp 2
    "A": {
        "sizes": {"world": 8, "tp": 2, "cp": 1, "pp": 2, "ep": 1, "etp": 1},
        "dense": {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": [[0], [1], [2], [3], [4], [5], [6], [7]],
            "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp-cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "tp-pp": [[0, 1, 4, 5], [2, 3, 6, 7]],
            "tp-cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "tp-dp-cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        },
        "expert": {
            "tp": [[0], [1], [2], [3], [4], [5], [6], [7]],
            "ep": [[0], [1], [2], [3], [4], [5], [6], [7]],
            "dp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "tp-ep": [[0], [1], [2], [3], [4], [5], [6], [7]],
            "tp-ep-pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    },
    # world 16: dense tp 2 x cp 2 x dp 2 x pp 2; expert etp 1 x ep 1 x edp 8 x pp 2
    "B": {
        "sizes": {"world": 16, "tp": 2, "cp": 2, "pp": 2, "ep": 1, "etp": 1},
        "dense": {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            "dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
            "tp-pp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
            "tp-cp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
            "tp-dp-cp": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
        },
        "expert": {
            "tp": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
            "ep": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
            "dp": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
            "tp-ep": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
            "tp-ep-pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
            "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
        },
    },
    # world 8: dense tp 4 x cp 1 x dp 2 x pp 1; expert etp 1 x ep 8 x edp 1 x pp 1
    "C": {
        "sizes": {"world": 8, "tp": 4, "cp": 1, "pp": 1, "ep": 8, "etp": 1},
        "dense": {
            "tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "cp": [[0], [1], [2], [3], [4], [5], [6], [7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "dp-cp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
            "tp-pp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "tp-cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "tp-dp-cp": [[0, 1, 2, 3, 4, 5, 6, 7]],
        },
        "expert": {
            "tp": [[0], [1], [2], [3], [4], [5], [6], [7]],
            "ep": [[0, 1, 2, 3, 4, 5, 6, 7]],
            "dp": [[0], [1], [2], [3], [4], [5], [6], [7]],
            "tp-ep": [[0, 1, 2, 3, 4, 5, 6, 7]],
            "tp-ep-pp": [[0, 1, 2, 3, 4, 5, 6, 7]],
            "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        },
    },
    # world 16: dense tp 2 x cp 2 x dp 2 x pp 2; expert etp 1 x ep 4 x edp 2 x pp 2
    "D": {
        "sizes": {"world": 16, "tp": 2, "cp": 2, "pp": 2, "ep": 4, "etp": 1},
        "dense": {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            "dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
            "tp-pp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
            "tp-cp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
            "tp-dp-cp": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
        },
        "expert": {
            "tp": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            "tp-ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
            "tp-ep-pp": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
            "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
        },
    },
    # world 32: dense tp 4 x cp 1 x dp 4 x pp 2; expert etp 2 x ep 2 x edp 4 x pp 2
    "E": {
        "sizes": {"world": 32, "tp": 4, "cp": 1, "pp": 2, "ep": 2, "etp": 2},
        "dense": {
            "tp": [
                [0, 1, 2, 3],
                [4, 5, 6, 7],
                [8, 9, 10, 11],
                [12, 13, 14, 15],
                [16, 17, 18, 19],
                [20, 21, 22, 23],
                [24, 25, 26, 27],
                [28, 29, 30, 31],
            ],
            "cp": [
                [0],
                [1],
                [2],
                [3],
                [4],
                [5],
                [6],
                [7],
                [8],
                [9],
                [10],
                [11],
                [12],
                [13],
                [14],
                [15],
                [16],
                [17],
                [18],
                [19],
                [20],
                [21],
                [22],
                [23],
                [24],
                [25],
                [26],
                [27],
                [28],
                [29],
                [30],
                [31],
            ],
            "dp": [
                [0, 4, 8, 12],
                [1, 5, 9, 13],
                [2, 6, 10, 14],
                [3, 7, 11, 15],
                [16, 20, 24, 28],
                [17, 21, 25, 29],
                [18, 22, 26, 30],
                [19, 23, 27, 31],
            ],
            "dp-cp": [
                [0, 4, 8, 12],
                [1, 5, 9, 13],
                [2, 6, 10, 14],
                [3, 7, 11, 15],
                [16, 20, 24, 28],
                [17, 21, 25, 29],
                [18, 22, 26, 30],
                [19, 23, 27, 31],
            ],
            "pp": [
                [0, 16],
                [1, 17],
                [2, 18],
                [3, 19],
                [4, 20],
                [5, 21],
                [6, 22],
                [7, 23],
                [8, 24],
                [9, 25],
                [10, 26],
                [11, 27],
                [12, 28],
                [13, 29],
                [14, 30],
                [15, 31],
            ],
            "tp-pp": [
                [0, 1, 2, 3, 16, 17, 18, 19],
                [4, 5, 6, 7, 20, 21, 22, 23],
                [8, 9, 10, 11, 24, 25, 26, 27],
                [12, 13, 14, 15, 28, 29, 30, 31],
            ],
            "tp-cp": [
                [0, 1, 2, 3],
                [4, 5, 6, 7],
                [8, 9, 10, 11],
                [12, 13, 14, 15],
                [16, 17, 18, 19],
                [20, 21, 22, 23],
                [24, 25, 26, 27],
                [28, 29, 30, 31],
            ],
            "tp-dp-cp": [
                [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
                [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
            ],
        },
        "expert": {
            "tp": [
                [0, 1],
                [2, 3],
                [4, 5],
                [6, 7],
                [8, 9],
                [10, 11],
                [12, 13],
                [14, 15],
                [16, 17],
                [18, 19],
                [20, 21],
                [22, 23],
                [24, 25],
                [26, 27],
                [28, 29],
                [30, 31],
            ],
            "ep": [
                [0, 2],
                [1, 3],
                [4, 6],
                [5, 7],
                [8, 10],
                [9, 11],
                [12, 14],
                [13, 15],
                [16, 18],
                [17, 19],
                [20, 22],
                [21, 23],
                [24, 26],
                [25, 27],
                [28, 30],
                [29, 31],
            ],
            "dp": [
                [0, 4, 8, 12],
                [1, 5, 9, 13],
                [2, 6, 10, 14],
                [3, 7, 11, 15],
                [16, 20, 24, 28],
                [17, 21, 25, 29],
                [18, 22, 26, 30],
                [19, 23, 27, 31],
            ],
            "tp-ep": [
                [0, 1, 2, 3],
                [4, 5, 6, 7],
                [8, 9, 10, 11],
                [12, 13, 14, 15],
                [16, 17, 18, 19],
                [20, 21, 22, 23],
                [24, 25, 26, 27],
                [28, 29, 30, 31],
            ],
            "tp-ep-pp": [
                [0, 1, 2, 3, 16, 17, 18, 19],
                [4, 5, 6, 7, 20, 21, 22, 23],
                [8, 9, 10, 11, 24, 25, 26, 27],
                [12, 13, 14, 15, 28, 29, 30, 31],
            ],
            "pp": [
                [0, 16],
                [1, 17],
                [2, 18],
                [3, 19],
                [4, 20],
                [5, 21],
                [6, 22],
                [7, 23],
                [8, 24],
                [9, 25],
                [10, 26],
                [11, 27],
                [12, 28],
                [13, 29],
                [14, 30],
                [15, 31],
            ],
        },
    },
    # world 16: dense tp 2 x cp 1 x dp 4 x pp 2; expert etp 1 x ep 8 x edp 1 x pp 2
    "F": {
        "sizes": {"world": 16, "tp": 2, "cp": 1, "pp": 2, "ep": 8, "etp": 1},
        "dense": {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
            "cp": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
            "tp-pp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
            "tp-cp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
            "tp-dp-cp": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
        },
        "expert": {
            "tp": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
            "ep": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
            "dp": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
            "tp-ep": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
            "tp-ep-pp": [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]],
            "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
        },
    },
}
