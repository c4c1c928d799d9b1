-- apply_layout.lua: write a layout (MemoryStore.apply_layout): replace the specs, bump the version
-- when the digest changed, fail waiting tickets that can now never be granted (their owners are
-- told by pub/sub), run a grant pass, announce the version on the layout channel.
-- ARGV: now-override, replica, digest, json, pw, dw, backfill, ttl, max_scan, tier order, pools, tiers,
-- tenants
-- Reply: {changed 0/1, version}
local function main()
  local now = clock(ARGV[1])
  local digest = ARGV[3]
  local changed = 0
  if redis.call('HGET', K.layout, 'digest') ~= digest then
    changed = 1
    for _, pair in ipairs({ { K.pools, ARGV[11] }, { K.tiers, ARGV[12] }, { K.tenants, ARGV[13] } }) do
      redis.call('DEL', pair[1])
      local entries = split(pair[2], LSEP)
      for i = 1, #entries do
        local j = string.find(entries[i], SEP, 1, true)
        redis.call('HSET', pair[1], string.sub(entries[i], 1, j - 1), string.sub(entries[i], j + 1))
      end
    end
    redis.call('HINCRBY', K.layout, 'ver', 1)
    redis.call(
      'HSET', K.layout, 'digest', digest, 'json', ARGV[4], 'pw', ARGV[5], 'dw', ARGV[6], 'backfill', ARGV[7],
      'ttl', ARGV[8], 'max_scan', ARGV[9], 'tiers', ARGV[10]
    )
  end
  load_policy()
  reset_layout_cache()
  if changed == 1 then
    -- policy.drop_invalid
    local all = redis.call('HKEYS', K.tickets)
    for i = 1, #all do
      local tk = load_ticket(all[i])
      local err = check_demand(tk.d)
      if err then
        withdraw(all[i])
        local msg = 'F' .. SEP .. tk.seq .. SEP .. err[2] .. SEP .. err[3] .. SEP .. tostring(err[4] or '')
        notify(tk.owner, msg)
      end
    end
  end
  grant_pass(now, nil)
  if changed == 1 then
    redis.call('PUBLISH', K.layout, P.ver)
  end
  return { changed, tonumber(P.ver) }
end
