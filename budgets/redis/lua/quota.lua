-- quota.lua: budgets/quota.py's ledger (reserve, settle, expire), shared by the quota_* entries.
-- Keys (the domain's hash tag, so a Cluster keeps them in its slot): T:quota:<key>, a hash of the
-- quota's buckets ("<bucket>u" used, "<bucket>r" reserved; it expires when no window needs it);
-- T:qheld, reservation id -> its charges ("<key>SEP<bucket>SEP<amount>" joined by LSEP); T:qexp,
-- reservation id by expiry (script time).
local QU = {}

function QU.held_key()
  return T .. ':qheld'
end

function QU.exp_key()
  return T .. ':qexp'
end

-- quota.window_buckets: the window's buckets (bucket -> {used, reserved}) and their total; fields
-- of buckets before ``oldest`` are deleted.
function QU.window(key, oldest)
  local flat = rcall('HGETALL', key)
  local cells, total, stale = {}, 0, nil
  for i = 1, #flat, 2 do
    local f = flat[i]
    local bucket = ssub(f, 1, -2) + 0
    if bucket < oldest then
      stale = stale or {}
      stale[#stale + 1] = f
    else
      local v = flat[i + 1] + 0
      local cell = cells[bucket]
      if cell == nil then
        cell = { 0, 0 }
        cells[bucket] = cell
      end
      if sbyte(f, -1) == 117 then -- 'u'
        cell[1] = cell[1] + v
      else
        cell[2] = cell[2] + v
      end
      total = total + v
    end
  end
  if stale ~= nil then
    rcall('HDEL', key, unpack(stale))
  end
  return cells, total
end

-- quota.settle, given the reservation's record: per charge, ``actual`` (the i-th of A from
-- ``first``; missing or '' = the amount reserved) replaces the reservation in its bucket, unless
-- the bucket has left its window (its fields are gone).
function QU.settle(record, A, first)
  local charges = split(record, LSEP)
  for i = 1, #charges do
    local key, bucket, amount = unpack(split(charges[i], SEP))
    amount = amount + 0
    local rk = T .. ':quota:' .. key
    if rcall('HEXISTS', rk, bucket .. 'r') == 1 then
      local used = A and A[first + i - 1]
      if used == nil or used == '' then
        used = amount
      else
        used = mmax(0, mfloor(tonumber(used) or amount))
      end
      rcall('HINCRBY', rk, bucket .. 'r', -amount)
      rcall('HINCRBY', rk, bucket .. 'u', used)
    end
  end
end

-- Take reservation ``rid`` out; its record, nil when it is not held.
function QU.take(rid)
  local record = rcall('HGET', QU.held_key(), rid)
  if not record then
    return nil
  end
  rcall('HDEL', QU.held_key(), rid)
  rcall('ZREM', QU.exp_key(), rid)
  return record
end
