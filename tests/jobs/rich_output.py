"""A notebook's rich output after training, as notebooks write it: IPython's display re-imported, an HTML
object, a DataFrame, a string, and the notebook's own matplotlib plot shown with plt.show()."""

import matplotlib

matplotlib.use("Agg")  # a script's backend, as in a rank

import nbddp.runtime as rt

rt.setup()

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from IPython.display import HTML, display  # noqa: E402  (the re-import that used to override nbddp's)

display(HTML("<b>RICH-HTML</b>"))
display(pd.DataFrame({"loss": [0.5, 0.25]}))
display("PLAIN-TEXT")
plt.plot([1, 2, 3], [3, 2, 1])
plt.title("RICH-PLOT")
plt.show()
rt.print0("JOB OK", flush=True)
rt.cleanup()
