"""The built-in English text the tiny tokenizer is trained on. Plain prose written for tandem; it
only has to be varied enough that byte-level BPE learns a vocabulary of common English pieces."""

from __future__ import annotations

CORPUS = """\
The river ran slowly past the old mill, and the children sat on the bank to watch the water.
Every morning the baker opened his shop at six o'clock, and the smell of fresh bread filled the
street. People stopped on their way to work to buy a loaf, a roll, or a small sweet cake.

A computer is a machine that follows instructions. The instructions are called a program, and the
people who write them are called programmers. A program can add numbers, sort a list of names,
draw a picture on the screen, or send a message to another computer across the world.

In the spring the farmers plant their seeds. In the summer the fields turn green, and in the
autumn they turn gold. When the harvest is done, the families gather to share a meal and to thank
one another for a year of hard work. Winter is quiet; the snow covers the hills and the roads.

The library was the largest building in the town. It had three floors, a reading room with tall
windows, and a garden where students could sit and study in the afternoon. The librarian knew
where every book was kept, and she was always happy to help someone find what they were seeking.

Language models read text as a sequence of tokens. A token may be a whole word, part of a word,
a number, or a single character. The model looks at the tokens it has seen so far and predicts the
next one. When it is asked to write, it repeats this step again and again, one token at a time.

Serving a model to many users at once is a problem of scheduling. Requests arrive at different
times and ask for different amounts of work. A good server keeps the hardware busy, answers the
first token quickly, and never loses a token on the way back to the user.

She opened the window and looked at the sky. The clouds were moving fast from the west, and the
wind was growing stronger. "It will rain before evening," she said, and went to bring in the
washing from the line. Her brother laughed, but an hour later the first drops began to fall.

The train left the station at a quarter past nine. It carried people to the city for work, to the
coast for a holiday, and to the mountains for a long walk in the fresh air. The conductor checked
each ticket with a smile and wished every passenger a pleasant journey.

Water boils at one hundred degrees Celsius at sea level. At the top of a high mountain it boils at
a lower temperature, because the air pressure is lower. This is why cooking an egg takes longer in
the mountains than it does by the sea. Scientists measure such things carefully and write them down.

The market was full of colour and noise. There were apples, oranges, lemons, tomatoes, potatoes,
onions, carrots, and beans. A man was selling fish that had been caught that morning, and a woman
was selling flowers of every kind: roses, tulips, daisies, and sunflowers as tall as a child.

Good software is easy to read and easy to change. Each part does one thing and does it well. The
names in the code say what things are, the tests say what the code must do, and the comments say
why a choice was made. When something breaks, a clear error message saves hours of searching.

My grandfather used to tell stories about the sea. He had been a sailor when he was young, and he
had visited ports in many countries. He spoke of storms that lasted for days, of quiet nights under
the stars, and of the friends he had made on ships that have long since gone.

The museum opened a new exhibition about the history of writing. It showed clay tablets, paper
scrolls, printed books, and the first typewriters. Visitors could try to write their own names in
ancient scripts, and many of them spent the whole afternoon there, reading and asking questions.

Numbers are everywhere: 1, 2, 3, 10, 42, 100, 2024, 3.14, and 1000000. We count, we measure, we
compare, and we plan with them. A recipe needs 200 grams of flour, 2 eggs, and 150 millilitres of
milk. A journey of 300 kilometres at 100 kilometres per hour takes three hours.

What would you like to know? I can answer questions, explain ideas, summarise a long text, or help
you write a letter. Please tell me what you need, and I will do my best to help you. Thank you for
your patience, and have a wonderful day!
"""
