"""An agent for `configs/recipes/agent.yaml`: an ordinary program that talks to "an OpenAI
endpoint" with the official client, as an agent in any framework would. Astra runs it once per
sample with OPENAI_BASE_URL and OPENAI_API_KEY set to the RaaS's endpoint and the episode's key,
records every token of its calls, and trains on them.

It asks the model for the sum; when the reply is not a number it asks once more, the first
reply kept in the context (two calls, one growing conversation). Its last line is the answer
the recipe's reward scores.
"""

import os

from openai import OpenAI

client = OpenAI(max_retries=0)  # the endpoint and key from the environment
model, prompt = os.environ["ASTRA_MODEL"], os.environ["ASTRA_PROMPT"]

reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0)
answer = reply.choices[0].text.strip()
if not answer.isdigit():  # a second step: try again, seeing the first attempt
    context = prompt + reply.choices[0].text + "\n" + prompt
    again = client.completions.create(model=model, prompt=context, max_tokens=8, temperature=1.0)
    answer = again.choices[0].text.strip()
print(answer)
