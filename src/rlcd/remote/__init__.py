"""Evaluation of any System One endpoint: a client with retries, answers mapped to candidates, rlcd's statistics.

    client.py    SystemOneClient: /v1/models, /v1/systemone, Retry-After-aware retries
    answers.py   map_answer: a wire answer -> probabilities in candidate order (or why it is unusable)
    evaluate.py  evaluate_remote: D's rows -> requests -> prediction rows -> DIR/eval/ as a run's evaluation
"""
