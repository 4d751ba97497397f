"""When a run trains and what its time costs: off-peak windows and the window decision (windows), the plan of
nights (nights) from its inputs (inputs), prices and billing spans (cost), budgets (budget), the gate's decision
(gate), a night as it happened (night_record), renting vs owning (rent_vs_buy), and the errors (errors). Every
function takes the current time as an argument. Import from the module that owns a name: this re-exports nothing."""
