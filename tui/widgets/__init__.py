"""The panes of the main screen. Each renders a part of a Frame it is given as an
attribute, and reports what the user picks as a message; none reads files or the clock."""
