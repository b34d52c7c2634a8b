"""The dialogs over the main screen: help, go to, breakpoints."""
