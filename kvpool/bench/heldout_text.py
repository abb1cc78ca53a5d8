"""A held-out English text for perplexity measurements (`kvpool bench precision`, the KV
quantization accuracy tests): prose written for this project, so no model has memorised it.
About 2,350 tokens in SmolLM2's tokenizer.
"""

TEXT = """\
The canal village of Marrow End has never been on the way to anywhere. The towpath runs past \
it, the barges slow down to pass under its low stone bridge, and then they go on towards the \
mills and the market towns, leaving the place much as they found it. For most of the year the \
water is the colour of strong tea, and in the mornings a thin mist lies on it until the sun is \
high enough to burn it away.

The lock keeper, a tall woman called Agnes Pell, has worked the lock for thirty-one years. She \
knows every boat by the sound of its engine and most of the boatmen by the way they throw a \
rope. In spring she paints the balance beams white, because, she says, a beam that can be seen \
in the dark is a beam that nobody walks into. In summer she sells eggs and lettuces from a \
table by her door, and she leaves a tin for the money when she goes inside to make her tea. \
The tin has never been stolen, although once, many years ago, somebody left a button in it \
instead of a coin, and the village talked about nothing else for a week.

Autumn is the busy season. The apples from the orchards on the hill come down to the wharf in \
wooden crates, and for a few weeks the air smells of fruit and diesel and wet leaves. Children \
who are supposed to be at school find reasons to be near the water. The baker makes a cake \
with the first of the apples and cuts it into squares for anyone who has helped with the \
loading, and there is always some argument about who has helped and who has only watched.

In winter the canal sometimes freezes at the edges, and the ducks stand on the ice looking \
offended. The boats come less often. Agnes mends the lock gates, reads the books that the \
library van brings on the first Thursday of each month, and writes letters to a nephew in \
Canada who has never once written back. She does not seem to mind. Letters, she says, are \
not really for the person who reads them; they are a way of putting your own thoughts in \
order, the way you might sweep a floor before anyone comes to visit.

Visitors do come, now and then. A walker will stop on the bridge to ask the way, or a family \
on a hired boat will tie up for the night and knock on her door to ask whether the water is \
safe to drink. She tells them the truth, which is that it is not, and gives them a jug from \
her own tap. Most of them send a postcard afterwards. She keeps the postcards in a shoebox \
under the stairs, and on long evenings she takes them out and reads them again, one by one, \
as if they were news from a large and interesting family that she has somehow never met.

The spring after the great flood, the canal company sent a young engineer to look at the \
bridge. His name was Tobias Wren, and he arrived on a Monday with a leather case full of \
drawings and a pair of boots that were far too clean. He measured the arch, tapped the stones \
with a small hammer, and wrote figures in a notebook that he kept in his breast pocket. Agnes \
watched him from her doorway for most of the morning before she offered him a cup of tea, and \
he accepted it with the relief of a man who had not expected anyone to be kind to him.

He told her that the company was worried about the foundations. The flood had scoured the \
bed of the canal, he said, and the water might have found its way behind the old stonework. \
If that were so, the bridge could stand for another hundred years or fall down next winter, \
and there was no way of knowing which without a proper survey. Agnes listened, nodded, and \
then took him down to the water's edge, where she showed him a line of bubbles rising slowly \
from the mud beside the second pier. She had noticed them in February, she said, and had \
written to the company about them twice. Nobody had written back.

Tobias stayed for three weeks. He lodged above the baker's shop, and every morning he walked \
to the bridge with a different instrument: a brass level, a long pole marked in feet and \
inches, a lamp that he lowered into the water on a chain. The children followed him wherever \
he went and asked him questions that he answered with great seriousness, as if they were \
members of the board. By the end of the first week they could explain, to anyone who would \
listen, the difference between a pier and an abutment, and why the water under a bridge runs \
faster than the water on either side of it.

The survey found what Agnes had already guessed. Behind the second pier there was a hollow \
the size of a small room, full of loose gravel and black water, and the stones above it had \
begun to lean. The company decided that the bridge would be repaired in the summer, when the \
traffic on the canal was lightest, and that the lock would be closed for a month while the \
work was done. This news travelled through the village faster than the flood had, and it was \
received with much the same mixture of alarm and excitement.

For the boatmen, a closed lock meant a long detour by the river, two extra days on every \
journey and a toll at the weir that most of them could not afford. For the baker it meant a \
month without the morning trade from the barges. For the children it meant a month of \
watching men in heavy boots pump the canal dry, which was the most interesting thing that \
had happened in Marrow End since the button was found in the tin. Agnes, for her part, said \
that she had been wanting to paint the inside of the lock chamber for years, and that she \
would finally have the chance.

The work began in the first week of July. A steam pump was brought up on a flat barge and \
set up beside the towpath, and for four days it coughed and hammered while the water in the \
pound between the two locks went slowly down. As the level dropped, the canal gave up its \
secrets: a bicycle, several bottles, a cast iron stove, a surprising number of boots, and a \
small wooden boat that nobody could remember having seen before. The children carried the \
boat to the baker's yard, scraped off the mud, and found a name painted on its stern in \
faded blue letters. It said Patience, and underneath, in smaller letters, Marrow End.

Nobody in the village knew whose boat it had been. The oldest man in the parish, who had \
worked on the canal as a boy, thought that there had once been a ferryman at the bridge, \
before the bridge was built, and that the ferry might have been called something of the \
kind. The vicar looked through the parish records and found, in a register from more than a \
century before, the burial of a man described as a waterman of this place, with no other \
name given. It was not much, but it was enough for a story, and by the end of the summer \
the village had decided that Patience was the ferryman's boat and that the ferryman had been \
a patient man, which seemed, on the whole, a reasonable thing to believe.

Meanwhile the masons worked on the bridge. They cut away the damaged stones, filled the \
hollow behind the pier with concrete, and built the face of the pier again from new blocks \
that had come by rail from a quarry in the north. The new stone was pale and sharp edged \
beside the old, and Tobias, who had come back to oversee the work, said that it would take \
twenty years of weather before anyone could tell the difference. Agnes said that she would \
be able to tell the difference in a hundred years, and that she did not mind, because a \
mended thing is often more interesting than a thing that has never been broken.

When the lock chamber was dry, Agnes climbed down into it with a bucket of whitewash and a \
brush tied to a broom handle. She painted the walls from the bottom up, as far as she could \
reach, and then she stood on a ladder and painted the rest. It took her nine days. On the \
tenth day the masons finished the bridge, the pump was started in reverse, and the water \
came back into the pound, brown and cold, rising a few inches every hour. By the evening of \
the eleventh day it had reached the old level, and the first barge in a month came through \
the lock, its engine loud in the quiet, its crew waving as if they had been away at sea.

Tobias left the following morning. He shook hands with the baker and the vicar, gave the \
children a drawing of the bridge with all the parts labelled, and thanked Agnes for the tea, \
which he said had been the best part of the survey. She gave him a dozen eggs in a basket \
and told him to come back when the new stone had weathered, so that he could see whether he \
had been right about the twenty years. He promised that he would, and although nobody in \
the village expected him to keep the promise, he did.

He came back eleven years later, older and heavier, with a wife and two small daughters who \
had heard a great deal about the lock keeper and the bridge and the boat called Patience. \
The boat by then hung on the wall of the baker's shop, above the counter, where it had become \
so familiar that most of the customers no longer looked at it. The new stone on the pier had \
turned a soft grey, and the children who had followed him about with questions were grown, \
and some of them had children of their own. Agnes was still at the lock. Her hair was white \
and she walked more slowly, but she still painted the balance beams every spring, and she \
still left the tin on the table when she went inside to make her tea.

They sat together on the bench by her door while the girls ran up and down the towpath, and \
Tobias told her about the bridges he had built and the rivers he had crossed, in places whose \
names she had only seen on the labels of tins. She listened, as she always listened, with her \
hands folded in her lap, and when he had finished she said that it sounded like a very full \
life, and that she was glad he had come back to tell her about it. Then she went inside and \
came out again with a shoebox, and showed him the postcards, one by one, and the girls came \
back from the towpath and sat on the grass to listen, and the afternoon went on in that way \
until the light began to fail and the mist came up off the water, as it always did.

Years afterwards, when Agnes had retired and a younger keeper had taken over the lock, the \
village put a small brass plate on the bridge. It gives the date of the flood and the date \
of the repair, and underneath, in letters that are already beginning to wear, it says that \
the lock keeper saw the danger first. Most people who cross the bridge do not stop to read \
it. The barges still slow down to pass under the arch, and the water is still the colour of \
strong tea, and in the mornings the mist still lies on the canal until the sun is high enough \
to burn it away.
"""
