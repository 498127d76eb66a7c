"""`miles_vf_echo`: a two-turn echo task with a two-criterion rubric, for the Miles tests.

The user asks the model to say a word; after its first reply the environment asks once more
("Again: say <word>."). The rubric scores the episode on two criteria: `says_word` (weight 1.0:
the word is in the last reply) and `brief` (weight 0.5: the share of replies of at most 24
characters). A metric counts the model's turns. The harness is an in-process chat loop (no
program to install): every model call goes to the interception endpoint Verifiers hands it,
which relays it to the policy's endpoint, Miles' session server in the tests.
"""

from miles_vf_echo.harness import EchoHarness
from miles_vf_echo.taskset import EchoTaskset

__all__ = ["EchoTaskset", "EchoHarness"]
