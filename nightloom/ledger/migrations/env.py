"""Alembic environment of the ledger: migrate the connection `Ledger` hands over in `config.attributes["connection"]`
(inside its transaction), or, offline (`--sql`), print the SQL for the dialect of `sqlalchemy.url`."""

from alembic import context

from nightloom.ledger.migrations import VERSION_TABLE

config = context.config

if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        version_table=VERSION_TABLE,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("the ledger migrations run on a connection: open the ledger with nightloom.ledger.Ledger")
    context.configure(connection=connection, version_table=VERSION_TABLE, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
